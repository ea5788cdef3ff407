# Sourced by install.sh and install-horovod.sh: `pip_install ARGS...` installs into $PY as `pip install ARGS...`
# would, through uv (https://docs.astral.sh/uv/), which unpacks and byte-compiles on every core (install.sh's header
# has the figures). uv is put into $PY by pip the first time, at a pinned version.
#
# uv reads neither pip's configuration nor its certificate setting, so two of pip's are passed on: the find-links
# folders pip is configured with (the development machines keep the CPU build of torch in one), and the machine's own
# certificate store (--system-certs: a proxy's certificate authority that the machine trusts, as pip's PIP_CERT does
# here). PARBENCH_UV_VERSION moves the pin.
pip_install() {
    if ! "$PY" -m uv --version >/dev/null 2>&1; then
        "$PY" -m pip install -q "uv==${PARBENCH_UV_VERSION:-0.13.9}"
    fi
    local links=() folder
    for folder in ${PIP_FIND_LINKS:-$("$PY" -m pip config get global.find-links 2>/dev/null || true)}; do
        links+=(--find-links "$folder")
    done
    "$PY" -m uv pip install -q --python "$PY" --compile-bytecode --system-certs "${links[@]}" "$@"
}
