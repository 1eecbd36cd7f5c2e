#!/usr/bin/env bash
# Does ungrouped, rated production traffic improve the served model? (issue #29's measure)
#
#   bash bench/traffic_efficacy.sh OUT_DIR [loop-run overrides ...]     (from a clone with no runs/agent_rl)
#   CYCLE_SECONDS=60 SEEDS=0 bash bench/traffic_efficacy.sh OUT_DIR      (a quick check of the script itself)
#
# `loop serve` serves the base; an outside process (examples/outside_traffic.py with the OpenAI Agents
# SDK agent) plays fresh calculator train problems ONCE each, 64 a round, 10 s between rounds, and
# posts a thumbs-up or -down per episode; `loop run collect.source=traffic` trains on what arrives
# (512 rated episodes a cycle). The version serving 900 s after cycle 1 began is then played by the
# same SDK agent on the 200 eval problems (never trained or gated on) beside the base, sampling seeds
# 0, 1, 2 (`loop eval ... task.agent=... task.source=TASKS engine.seed=S`). Prints the gain with its
# 90% t-interval paired by seed. Logs: OUT_DIR/{serve,traffic,run,eval}.log. ~15 min of cycles,
# ~6 min of evaluation on 2 cores; nothing else should run meanwhile.
set -u
CYCLE_SECONDS=${CYCLE_SECONDS:-900} SEEDS=${SEEDS:-0 1 2}
OUT=$(mkdir -p "$1" && cd "$1" && pwd); shift
cd "$(dirname "$0")/.."
[ -e runs/agent_rl ] && { echo "runs/agent_rl exists: run from a fresh clone (a finished run would serve its last version)" >&2; exit 2; }
export FLYWHEEL_ADMIN_TOKEN=${FLYWHEEL_ADMIN_TOKEN:-bench-$RANDOM$RANDOM}
URL=http://127.0.0.1:8000
./fw loop serve conf/agent_rl.yaml > "$OUT/serve.log" 2>&1 &
SERVE=$! TRAFFIC="" RUN=""
trap 'kill $SERVE $TRAFFIC $RUN 2>/dev/null' EXIT
until curl -sf $URL/health >/dev/null 2>&1; do kill -0 $SERVE || { tail "$OUT/serve.log"; exit 1; }; sleep 5; done
./fw python examples/outside_traffic.py --url $URL --agent examples/agents_sdk_calculator.py:play --pause-s 10 \
  > "$OUT/traffic.log" 2>&1 &
TRAFFIC=$!
./fw loop run conf/agent_rl.yaml collect.source=traffic collect.endpoint=$URL collect.min_episodes=512 \
  collect.max_episodes=512 loop.cycles=20 "$@" > "$OUT/run.log" 2>&1 &
RUN=$!
STATE=runs/agent_rl/loop_state.json
until [ -f $STATE ] && grep -q '"k": 1' $STATE; do kill -0 $RUN || { tail "$OUT/run.log"; exit 1; }; sleep 2; done
T0=$(date +%s)
BASE=$(./fw python -c "import json; print(json.load(open('$STATE'))['base']['path'])")
while kill -0 $RUN 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt $CYCLE_SECONDS ]; do sleep 5; done
FINAL=$(./fw python -c "import json; print(json.load(open('$STATE'))['serving']['path'])")
./fw python -c "
import json; s = json.load(open('$STATE'))
for c in s['cycles']: print('cycle', c['k'], c['outcome'], {k: round(v) for k, v in c['timings'].items()})" | tee "$OUT/cycles.txt"
kill -INT $RUN 2>/dev/null; sleep 10; kill $RUN $TRAFFIC $SERVE 2>/dev/null; wait 2>/dev/null
while curl -sf $URL/health >/dev/null 2>&1; do sleep 2; done  # the server's engine gone before the evaluations
echo "serving at $CYCLE_SECONDS s: $FINAL; base: $BASE" | tee -a "$OUT/cycles.txt"

./fw python - "$OUT/tasks.jsonl" <<'EOF'
import json, sys
from rollout.tasks.calculator import make_problems
with open(sys.argv[1], "w") as f:  # a few train rows (the source needs both splits), the 200 eval problems
    for split, n in (("train", 8), ("eval", 200)):
        for p in make_problems(split, n, 0):
            f.write(json.dumps({"split": split, "question": p.question, "answer": p.answer}) + "\n")
EOF
for S in $SEEDS; do for M in "$FINAL" "$BASE"; do
  echo "seed $S model $M $(./fw loop eval conf/agent_rl.yaml "$M" task.agent=examples/agents_sdk_calculator.py:play \
       task.source="$OUT/tasks.jsonl" engine.seed=$S --json 2>>"$OUT/eval.err" | tail -1)" >> "$OUT/eval.log"
done; done
./fw python - "$OUT/eval.log" <<'EOF'
import json, re, statistics as st, sys
by = {}
for line in open(sys.argv[1]):
    if m := re.match(r"seed (\d+) model \S+ (\{.*\})", line.strip()):
        by.setdefault(int(m.group(1)), []).append(100 * json.loads(m.group(2))["success"])
after, before = zip(*(v for v in by.values() if len(v) == 2))
d = [a - b for a, b in zip(after, before)]
t = {1: float("nan"), 2: 6.314, 3: 2.920, 4: 2.353, 5: 2.132}[len(d)]  # t(0.95, n-1): a two-sided 90% interval
half = t * st.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
print(f"through the SDK agent, 200 eval problems, seeds 0-{len(d) - 1}: base {', '.join(f'{b:.1f}' for b in before)}% "
      f"-> {', '.join(f'{a:.1f}' for a in after)}%: gain {st.mean(d):+.1f} [{st.mean(d) - half:+.1f}, {st.mean(d) + half:+.1f}]")
EOF
