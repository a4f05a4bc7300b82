#!/usr/bin/env bash
# The interactive prompt through a real terminal: tmux runs gpush, send-keys
# types, capture-pane reads the screen. Usage: tests/repl/test_repl.sh [build/gpush]
set -u
GPUSH=${1:-build/gpush}
if ! command -v tmux >/dev/null 2>&1; then
  echo "repl tests: skipped (tmux is not installed; make deps installs it)"
  exit 0
fi
GPUSH=$(cd "$(dirname "$GPUSH")" && pwd)/$(basename "$GPUSH")
TMP=$(mktemp -d)
SOCK="gpush-repl-test-$$"
S=repl
export GPUSH_HISTORY="$TMP/history" GPUSH_CACHE="$TMP/cache"
pass=0 fail=0

cleanup() { tmux -L "$SOCK" kill-server >/dev/null 2>&1; rm -rf "$TMP"; }
trap cleanup EXIT

screen() { tmux -L "$SOCK" capture-pane -t "$S" -p -S -200 2>/dev/null; }
keys() { tmux -L "$SOCK" send-keys -t "$S" "$@"; }
text() { tmux -L "$SOCK" send-keys -t "$S" -l "$1"; }

# wait until the screen matches a pattern (grep -E) COUNT times, up to 10 s
wait_for() {
  local pat=$1 count=${2:-1} i
  for i in $(seq 1 100); do
    [ "$(screen | grep -cE -- "$pat")" -ge "$count" ] && return 0
    sleep 0.1
  done
  return 1
}

check() { # name, pattern, [count]
  if wait_for "$2" "${3:-1}"; then
    pass=$((pass + 1)); echo "ok    repl: $1"
  else
    fail=$((fail + 1)); echo "FAIL  repl: $1 (expected /$2/ x${3:-1} on the screen)"; screen | sed 's/^/    | /'
  fi
}

tmux -L "$SOCK" new-session -d -s "$S" -x 120 -y 50 "'$GPUSH' --device cpu"
check 'the prompt starts' '^gp>'

text "error('boom')"; keys Enter
text '1 + 41'; keys Enter
check 'an error, then a working command' 'boom'
check 'an error, then a working command (value)' '^42$'

text 'function sq(a)'; keys Enter
check 'an incomplete chunk asks for more' '^>>'
text 'return a * a'; keys Enter
text 'end'; keys Enter
text 'sq(7)'; keys Enter
check 'a multi-line function' '^49$'

text 'while true do end'; keys Enter
sleep 0.5
keys C-c
check 'Ctrl-C stops an endless loop' 'interrupted'
text '2 + 2'; keys Enter
check 'the prompt goes on after Ctrl-C' '^4$'

text 'gp.ze'; keys Tab
sleep 0.3
text '{3}'; keys Enter
check 'Tab completes gp.ze to gp.zeros' 'gp> gp\.zeros\{3\}'
check 'the completed call runs' 'tensor\(\[0\., 0\., 0\.\]'

text 't = gp.ones{2}'; keys Enter
text 't:tr'; keys Tab
sleep 0.3
keys C-c
check 'Tab completes tensor methods' 'gp> t:transpose'

text 'print("never run'; sleep 0.2; keys C-c
text '100 + 23'; keys Enter
check 'Ctrl-C at the prompt drops the line' '^123$'
keys Up
sleep 0.2
keys Enter
check 'Up recalls the last line' '^123$' 2

# a line that begins with local declares a global of the session; =expr prints
text 'local yy = 5'; keys Enter
text 'yy'; keys Enter
check 'local x = ... persists to the next line' '^5$'
text '=yy * 2'; keys Enter
check '=expr prints the value' '^10$'

# one error prefix (stdin:LINE:) whether the error comes from Lua or from gpush,
# and tracebacks with the typed code's frames only
text "gp.zeros{'3'}"; keys Enter
check 'a gpush error points at stdin' "^stdin:1: zeros: size '3' at dim 1 is a string"
text 'function ff(t) local r = t:matmul(t); return r end'; keys Enter
text 'ff(gp.zeros{2,3})'; keys Enter
check 'a traceback shows the typed function' "in function 'ff'"
check 'the error says the rule' "^stdin:1: matmul: inner dimensions differ"
if screen | grep -q 'lua/gpush/'; then
  fail=$((fail + 1)); echo "FAIL  repl: gpush's own frames are in a traceback without gp.debug"; screen | sed 's/^/    | /'
else
  pass=$((pass + 1)); echo "ok    repl: gpush's own frames are left out of tracebacks"
fi
text 'gp.debug = true'; keys Enter
text 'ff(gp.zeros{2,3})'; keys Enter
check 'gp.debug = true shows every frame' 'lua/gpush/core/ops/matmul.lua'
text 'gp.debug = nil'; keys Enter

# tensors: requires_grad in printing, help(t) by group, a mistyped method
text 'xg = gp.ones{2}:requires_grad()'; keys Enter
text 'xg'; keys Enter
check 'printing shows requires_grad' 'requires_grad=true\)'
text 'help(xg)'; keys Enter
check 'help(t) lists the methods by group' '^  views +view reshape'
text 'xg:tranpose(1, 2)'; keys Enter
check 'a mistyped method suggests the real one' "did you mean 'transpose'"

# a chunk left unfinished with Ctrl-C stays out of the history
text 'function abandoned_fn()'; keys Enter
check 'an unfinished chunk continues' '^>> ?$'
keys C-c
text '6 * 7'; keys Enter
check 'the prompt goes on after Ctrl-C at >>' '^42$' 2

keys C-d
sleep 0.5
if grep -q '100 + 23' "$GPUSH_HISTORY" 2>/dev/null && grep -q 'sq(7)' "$GPUSH_HISTORY"; then
  pass=$((pass + 1)); echo "ok    repl: history is saved to \$GPUSH_HISTORY"
else
  fail=$((fail + 1)); echo "FAIL  repl: history file $GPUSH_HISTORY"; cat "$GPUSH_HISTORY" 2>/dev/null
fi
if grep -q 'abandoned_fn\|never run' "$GPUSH_HISTORY" 2>/dev/null; then
  fail=$((fail + 1)); echo "FAIL  repl: a line dropped with Ctrl-C is in the history"; cat "$GPUSH_HISTORY"
else
  pass=$((pass + 1)); echo "ok    repl: lines dropped with Ctrl-C stay out of the history"
fi
if screen | grep -q 'never run'; then
  if screen | grep -q '^never run'; then fail=$((fail + 1)); echo "FAIL  repl: a line dropped by Ctrl-C ran"; fi
fi

echo "repl tests: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
