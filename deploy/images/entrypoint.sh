#!/bin/sh
# hrl-entrypoint: run one harnessrl process in a container, listed for Prometheus while it runs.
#
#   hrl-entrypoint [JOB] COMMAND [ARG...]
#
# JOB (e.g. hrl-actor) is the Prometheus job of deploy/monitoring/prometheus.yml; without one,
# or without $HRL_SCRAPE_DIR, the command simply runs. With both:
#   * the process gets a free /metrics port (appended as --metrics-port PORT), or
#     $HRL_METRICS_PORT when the command serves metrics on a port of its own (the engine);
#   * $HRL_SCRAPE_DIR/JOB-PROCESS.json, a Prometheus file_sd target group
#     ($HRL_SCRAPE_HOST:PORT, labels run=$HRL_RUN and process=PROCESS), exists while it runs
#     and is removed when it ends;
#   * PROCESS is $HRL_PROCESS, else JOB without "hrl-" plus 8 random hex digits, unique per
#     container, so replicas (docker-compose --scale actor=N) are told apart; with
#     $HRL_PASS_NAME=1 it is also passed as --name (the actor's instance name).
# Signals are passed on; the exit status is the command's.
set -eu
case "${1:-}" in
  hrl-*) job=$1; shift ;;
  *) job="" ;;
esac
[ $# -gt 0 ] || { echo "usage: hrl-entrypoint [JOB] COMMAND [ARG...]" >&2; exit 2; }
if [ -z "$job" ] || [ -z "${HRL_SCRAPE_DIR:-}" ]; then
  exec "$@"
fi
rand=$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')
process=${HRL_PROCESS:-${job#hrl-}-$rand}
if [ "${HRL_PASS_NAME:-0}" = 1 ]; then
  set -- "$@" --name "$process"
fi
if [ -n "${HRL_METRICS_PORT:-}" ]; then
  port=$HRL_METRICS_PORT
else
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
  set -- "$@" --metrics-port "$port"
fi
target="$HRL_SCRAPE_DIR/$job-$process.json"
mkdir -p "$HRL_SCRAPE_DIR"
printf '[{"targets": ["%s:%s"], "labels": {"run": "%s", "process": "%s"}}]\n' \
  "${HRL_SCRAPE_HOST:-127.0.0.1}" "$port" "${HRL_RUN:-default}" "$process" > "$target.tmp"
mv "$target.tmp" "$target"
# the trap first: a stop that comes while the command starts is passed on, not lost
child=""
sig=0
trap 'sig=$((sig + 1)); [ -z "$child" ] || kill -TERM "$child" 2>/dev/null || true' TERM INT
"$@" &
child=$!
[ "$sig" = 0 ] || kill -TERM "$child" 2>/dev/null || true
set +e
while :; do  # a trapped signal interrupts wait (status 128+n): wait again for the command's
  seen=$sig
  wait "$child"
  rc=$?
  [ "$sig" != "$seen" ] && [ "$rc" -gt 128 ] || break
done
rm -f "$target"
exit "$rc"
