"""transformers peer of scripts/bench/models.lua: the same weights (a directory
gp.models.save wrote, with ids.json: the prefill and prompt token ids), the
same prefill and greedy decode, timed on the GPU. Modes:
  eager    model(ids) and model.generate(...) as they come (dynamic cache)
  compile  the static cache (generation_config.cache_implementation = "static"),
           whose decoding forward generate compiles with torch.compile
           (fullgraph, mode="reduce-overhead"): the fastest configuration of
           transformers' own generate
Prints one JSON line per measurement:
  {"mode", "what": "prefill"|"decode", "batch", "tokens_per_s", "s"}
(decode: new tokens of every row over the whole generate call, prefill
included, median of --reps calls after a warm-up call)."""
import argparse
import json
import statistics
import time

import torch
import transformers

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--dtype", default="bf16")
p.add_argument("--batches", default="1,16")
p.add_argument("--max-new", type=int, default=128)
p.add_argument("--reps", type=int, default=3)
p.add_argument("--modes", default="eager,compile")
a = p.parse_args()
dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
ids = json.load(open(a.dir + "/ids.json"))
prefill = torch.tensor([ids["prefill"]], device="cuda")
prompt = torch.tensor([ids["prompt"]], device="cuda")


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


for mode in a.modes.split(","):
    model = transformers.AutoModelForCausalLM.from_pretrained(a.dir, dtype=dt).cuda().eval()
    model.generation_config.eos_token_id = None  # every row runs max_new tokens, as gpush's do
    model.generation_config.pad_token_id = 0
    if mode == "compile":
        # transformers' generate compiles the decoding forward itself when the
        # cache is static (its CompileConfig: torch.compile fullgraph,
        # mode "reduce-overhead"); compiling model.forward by hand on top of
        # that makes the CUDA-graph outputs be overwritten between steps
        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        if mode == "eager":  # the compiled forward is for decode shapes; prefill is timed eager only
            s = timed(lambda: model(prefill), 10)
            print(json.dumps({"mode": mode, "what": "prefill", "tokens": prefill.shape[1], "s": s,
                              "tokens_per_s": prefill.shape[1] / s}), flush=True)
        for b in [int(x) for x in a.batches.split(",")]:
            x = prompt.repeat(b, 1)
            s = timed(lambda: model.generate(x, max_new_tokens=a.max_new, min_new_tokens=a.max_new, do_sample=False),
                      a.reps)
            print(json.dumps({"mode": mode, "what": "decode", "batch": b, "s": s, "tokens_per_s": b * a.max_new / s}),
                  flush=True)
    del model
    torch.cuda.empty_cache()
