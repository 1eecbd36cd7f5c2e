#!/bin/sh
# First start: a cluster with the `mlflow` role and database, its password from $POSTGRES_PASSWORD
# (a Kubernetes Secret); then the server, listening on the pod's address.
set -eu
BIN=/usr/lib/postgresql/15/bin
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pw=$(mktemp); printf '%s' "${POSTGRES_PASSWORD:?a password, from a Secret}" > "$pw"
  "$BIN/initdb" -D "$PGDATA" -U mlflow --pwfile="$pw" --auth-local=trust --auth-host=scram-sha-256; rm -f "$pw"
  echo "host all all 0.0.0.0/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
  "$BIN/pg_ctl" -D "$PGDATA" -w -o "-c listen_addresses=''" start
  "$BIN/createdb" -U mlflow mlflow
  "$BIN/pg_ctl" -D "$PGDATA" -w stop
fi
exec "$BIN/postgres" -D "$PGDATA" -c listen_addresses='*'
