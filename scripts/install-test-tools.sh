#!/usr/bin/env bash
# System tools the tests use: Debian's slurm-wlm and munge (a real one-node Slurm cluster), iproute2
# (network namespaces as hosts) and openssh-server (an sshd in each namespace host, which horovodrun -H
# reaches by ssh) for the multi-node tests; chromium, in which a test renders the HTML report headless.
# Installed with apt where we are root and they are missing; elsewhere this says what is missing and the
# tests needing it skip with that reason.
set -uo pipefail
packages=()
command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v slurmd >/dev/null || packages+=(slurm-wlm)
command -v munged >/dev/null || packages+=(munge)
command -v ip >/dev/null || packages+=(iproute2)
command -v sysctl >/dev/null || packages+=(procps)     # the emulated nodes' TCP congestion control
# sshd lives in /usr/sbin, which a non-root PATH may leave out; ssh-keygen comes with the client.
[ -x /usr/sbin/sshd ] && command -v ssh >/dev/null && command -v ssh-keygen >/dev/null || packages+=(openssh-server)
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || packages+=(chromium)
[ ${#packages[@]} = 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-test-tools: ${packages[*]} missing and not installable here (needs root and apt); the Slurm," \
         "namespace, ssh and report-rendering tests will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q "${packages[@]}" >/tmp/parbench-apt.log 2>&1; then
    apt-get update -q >>/tmp/parbench-apt.log 2>&1
    apt-get install -y -q "${packages[@]}" >>/tmp/parbench-apt.log 2>&1 \
        || { echo "install-test-tools: apt-get install ${packages[*]} failed; see /tmp/parbench-apt.log" >&2; exit 0; }
fi
echo "install-test-tools: installed ${packages[*]}"
