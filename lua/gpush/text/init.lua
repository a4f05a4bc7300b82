-- gpush.text: tokenizers and chat templates, on the host (no tensors needed).
-- The gp facade re-exports `tokenizer` as gp.tokenizer.
--
--   local tok = gp.tokenizer.load('models/smollm2')       -- a HF directory or a tokenizer.json
--   local ids = tok:encode('Hello world')                 -- 0-based ids, special tokens included
--   tok:decode(ids)                                       -- 'Hello world'
--   tok:apply_chat_template({{role = 'user', content = 'Hi'}}, {add_generation_prompt = true})
--   gp.tokenizer.from_gguf(meta)                          -- from the tokenizer.* keys of a GGUF file
local doc = require('gpush.core.doc').doc
local json = require 'gpush.core.json'
local rt = require 'gpush.core.runtime'
local T = require 'gpush.text.tokenizer'
local U = require 'gpush.text.unicode'
local gguf = require 'gpush.text.gguf'
local jinja = require 'gpush.text.jinja'

local M = {}
local tokenizer = {}
M.tokenizer = tokenizer
M.jinja = jinja

tokenizer.load = doc(T.load, "gp.tokenizer.load('dir' or 'tokenizer.json')",
  'a Hugging Face tokenizer: tokenizer.json (BPE, byte-level or with byte fallback; WordPiece; WordLevel), with bos/eos and the chat template from tokenizer_config.json beside it')
tokenizer.from_gguf = doc(gguf.from_gguf, 'gp.tokenizer.from_gguf(meta)',
  "a tokenizer from GGUF metadata (tokenizer.ggml.model 'gpt2' with llama.cpp's pre-tokenizer for tokenizer.ggml.pre, or 'llama'), with its chat template")
tokenizer.from_json = doc(function(spec, extra)
  if type(spec) == 'string' then
    local bad = U.invalid_at(spec) -- as tokenizers, which reads the text into a Rust String
    if bad then rt.raise(string.format('tokenizer.from_json: the text is not valid UTF-8 (byte %d)', bad)) end
    local ok, v = pcall(json.decode, spec)
    if not ok then rt.raise('tokenizer.from_json: not valid JSON (' .. tostring(v) .. ')') end
    spec = v
  end
  return T.from_spec(spec, 'the tokenizer table', extra)
end, 'gp.tokenizer.from_json(text_or_table, {config = tokenizer_config})',
  'a tokenizer from the content of a tokenizer.json (its text or the decoded table); config is a decoded tokenizer_config.json')
tokenizer.template = doc(function(source) return jinja.compile(source, 'chat template') end, 'gp.tokenizer.template(source)',
  "a compiled Jinja chat template (the subset model templates use); tpl:render{messages = ..., add_generation_prompt = true}")

local Tok = T.Tokenizer
doc(Tok.encode, "tok:encode(text, {add_special_tokens = true, truncation = true, padding = true, attention_mask = false})",
  "0-based ids of text as Hugging Face tokenizers' Tokenizer.encode(text).ids (the file's truncation and padding apply); with attention_mask, also the mask")
doc(Tok.encode_batch, 'tok:encode_batch({text, ...}, opts)', 'tok:encode of each text: a list of id lists')
doc(Tok.decode, 'tok:decode(ids, {skip_special_tokens = false})', "the text of ids (a list or a 1-D tensor) as tokenizers' decode")
doc(Tok.token_to_id, "tok:token_to_id('token')", 'the id of a token (added tokens first), or nil')
doc(Tok.stop_ids, 'tok:stop_ids()', "the ids that end a reply: eos and the end-of-turn tokens the vocabulary has (<|im_end|>, <|eot_id|>, ...); gp.generate's default stop with this tokenizer")
doc(Tok.id_to_token, 'tok:id_to_token(id)', 'the token of an id, or nil')
doc(Tok.apply_chat_template, "tok:apply_chat_template(messages, {add_generation_prompt = true, tools = ..., tokenize = false})",
  "the chat template rendered as transformers' apply_chat_template(messages, tokenize=False) renders it; other keys become template variables")
doc(jinja.Template.render, 'tpl:render(vars)', 'the text of a compiled template with vars (a table of names to values)')

return M
