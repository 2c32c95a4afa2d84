# Sourced by the scripts that bench against a `te serve` of this host: expects $te and
# $mem, makes a work folder ($work, removed on exit with the server) and defines
# `serve ARGS...`, which starts `te serve --backend tcp --mem $mem ARGS...` as $pid
# (under $serve_wrap, a command such as `taskset -c 1`, where set) and sets $target to
# the address it prints first.
work=$(mktemp -d)
pid=
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
serve() {
  rm -f "$work/serve"
  ${serve_wrap:-} "$te" serve --backend tcp --mem "$mem" "$@" >"$work/serve" 2>"$work/serve.err" &
  pid=$!
  for _ in $(seq 100); do
    [ -s "$work/serve" ] && break
    sleep 0.1
  done
  [ -s "$work/serve" ] || { echo "te serve $* did not start:" >&2; cat "$work/serve.err" >&2; exit 1; }
  target=$(head -n1 "$work/serve")
}
