#!/usr/bin/env bash
# `make system`: the system parts `make test` needs beyond the venv, installed and started in one go, as root or as a
# user with sudo (Debian/Ubuntu). Each step is skipped when its part is already there, so a second run takes seconds.
#   - docker.io + a running dockerd: the SWE-bench tests grade patches in containers
#   - debootstrap: builds the offline SWE-bench instance images (no Docker Hub needed)
#   - chromium + chromium-driver: the run board's tests drive a real headless browser
#   - Node 20 + npm, then the agent CLIs (qwen-code, claude-code, codex) into .npm-tools
#   - the offline SWE-bench instances (swe_instances.py) into runs/swe-instances, where `make test` looks
# Without them `make test` still runs: the tests that need a missing part skip, and its summary names the part.
set -euo pipefail
cd "$(dirname "$0")"
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
if [ -n "$SUDO" ] && ! command -v sudo >/dev/null; then
  echo "error: setup_system.sh needs root or sudo (apt-get, dockerd, debootstrap)" >&2
  exit 1
fi
step_start=$SECONDS
step() {  # the wall time of each step, in one closing line
  timings+="$1 $((SECONDS - step_start))s; "
  step_start=$SECONDS
}
timings=""
trap 'echo "setup_system.sh steps: $timings"' EXIT  # also when a step fails

packages=()
command -v dockerd >/dev/null || packages+=(docker.io)
command -v debootstrap >/dev/null || packages+=(debootstrap)
command -v chromium >/dev/null || packages+=(chromium)
command -v chromedriver >/dev/null || packages+=(chromium-driver)
command -v npm >/dev/null || packages+=(nodejs npm)
if [ ${#packages[@]} -gt 0 ]; then
  echo "apt-get install ${packages[*]}"
  $SUDO apt-get update -qq
  # `env`: with SUDO empty, a leading VAR=value after an expansion would be taken for the command's name.
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
fi
node_major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$node_major" -lt 20 ]; then
  echo "error: Node $(node --version) is too old for qwen-code 0.15 (needs 20 or newer): install Node 20" >&2
  exit 1
fi
step apt

if ! $SUDO docker info >/dev/null 2>&1; then
  echo "starting dockerd (log: /tmp/dockerd.log)"
  $SUDO sh -c 'nohup dockerd >/tmp/dockerd.log 2>&1 &'
  for _ in $(seq 60); do $SUDO docker info >/dev/null 2>&1 && break; sleep 1; done
  $SUDO docker info >/dev/null || { tail -20 /tmp/dockerd.log; exit 1; }
fi
[ -z "$SUDO" ] || $SUDO chmod 666 /var/run/docker.sock  # the tests talk to the daemon as this user
step dockerd

make venv .npm-tools/.kiln-installed-codex
step "venv+npm"

out="$PWD/runs/swe-instances"
$SUDO .venv/bin/python swe_instances.py --out "$out"  # debootstrap needs root
[ -z "$SUDO" ] || $SUDO chown -R "$(id -u):$(id -g)" "$out"
step instances
