#!/usr/bin/env bash
# An MLflow tracking server on PostgreSQL (Debian's postgresql package), artifacts proxied by the
# server (--serve-artifacts): what a team shares instead of each run's sqlite file.
#
#   infra/mlflow/server.sh start DIR [MLFLOW_PORT] [PG_PORT]   # prints the tracking URI
#   infra/mlflow/server.sh stop DIR
#   loop run conf/agent_rl.yaml mlflow.tracking_uri=http://127.0.0.1:5000
#
# DIR holds the database cluster (DIR/pg), the artifacts (DIR/artifacts) and both logs; a second
# start on the same DIR reuses them (a running database stays up: `stop` ends both). PostgreSQL refuses to run as root: as root the database runs
# as the `postgres` user. Python's driver is psycopg 3 (the `server` extra); the database URI says
# so (`postgresql+psycopg://`).
#
set -euo pipefail
cmd=${1:?start|stop}; dir=$(realpath -m "${2:?DIR}")
mlflow_port=${3:-5000}; pg_port=${4:-5433}
PGBIN=${PGBIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}
[ -x "$PGBIN/pg_ctl" ] || { echo "no PostgreSQL server binaries (apt install postgresql); PGBIN=$PGBIN" >&2; exit 3; }
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

if [ "$cmd" = stop ]; then
  [ -f "$dir/mlflow.pid" ] && kill -- "-$(cat "$dir/mlflow.pid")" 2>/dev/null || true  # its workers too
  rm -f "$dir/mlflow.pid"
  [ -d "$dir/pg" ] && as_pg "$PGBIN/pg_ctl" -D "$dir/pg" -m fast -w stop >/dev/null 2>&1 || true
  exit 0
fi
[ "$cmd" = start ] || { echo "usage: $0 start|stop DIR [MLFLOW_PORT] [PG_PORT]" >&2; exit 2; }

mkdir -p "$dir/artifacts"
if [ ! -f "$dir/pg/PG_VERSION" ]; then
  mkdir -p "$dir/pg"; [ "$(id -u)" = 0 ] && chown postgres "$dir/pg" "$dir"
  as_pg "$PGBIN/initdb" -D "$dir/pg" -U mlflow --auth=trust >"$dir/initdb.log" 2>&1
fi
[ "$(id -u)" = 0 ] && chown postgres "$dir"
as_pg "$PGBIN/pg_ctl" -D "$dir/pg" status >/dev/null 2>&1 || as_pg "$PGBIN/pg_ctl" -D "$dir/pg" \
  -l "$dir/postgres.log" -w -o "-p $pg_port -c listen_addresses=127.0.0.1 -c unix_socket_directories=''" start >/dev/null
as_pg "$PGBIN/createdb" -h 127.0.0.1 -p "$pg_port" -U mlflow mlflow 2>/dev/null || true  # exists on a restart
uri="postgresql+psycopg://mlflow@127.0.0.1:$pg_port/mlflow"
# its own process group (the pid file names it): the server's workers are its children
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid nohup mlflow server --backend-store-uri "$uri" --serve-artifacts \
  --artifacts-destination "$dir/artifacts" --host 127.0.0.1 --port "$mlflow_port" --workers 1 \
  >"$dir/mlflow.log" 2>&1 &
echo $! >"$dir/mlflow.pid"
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$mlflow_port/health" >/dev/null && { echo "http://127.0.0.1:$mlflow_port"; exit 0; }
  kill -0 "$(cat "$dir/mlflow.pid")" 2>/dev/null || break
  sleep 1
done
echo "the MLflow server did not come up; $dir/mlflow.log:" >&2; tail -20 "$dir/mlflow.log" >&2; exit 1
