"""The build-context paths a Dockerfile copies into its image: every COPY and ADD, as Docker's parser reads them.

What Docker reads and a line-by-line `startswith("COPY ")` would miss: instructions are case-insensitive and may be
indented; a line ending in the escape character (`\\`, or the one a `# escape=` directive names) continues on the next,
comment lines inside the continuation dropped; arguments come as words or as a JSON array (`COPY ["a b", "dest/"]`);
flags (`--chown=`, `--chmod=`, `--link`, ...) precede the sources, and `--from=` copies from another stage or image,
not from the context. An ADD source that is a URL or a git address is not in the context either. A heredoc
(`COPY <<EOF`) is refused: its text is in the Dockerfile itself, and nothing here reads it.
https://docs.docker.com/reference/dockerfile/ ("Parser directives", "COPY", "ADD").
"""

from __future__ import annotations

import json
import re
import shlex

COPYING = ("COPY", "ADD")
REMOTE = re.compile(r"^(https?://|git@|[a-z]+://)")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) for each instruction, continuations joined and comments dropped."""
    lines = text.splitlines()
    escape = "\\"
    for line in lines:                       # parser directives: comments of the form `# key=value`, first only
        directive = re.match(r"^#\s*escape\s*=\s*(\S)\s*$", line, re.IGNORECASE)
        if directive:
            escape = directive.group(1)
        elif not re.match(r"^#\s*\w+\s*=", line):
            break
    found: list[tuple[str, str]] = []
    pending = ""
    for line in lines:
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not pending):
            continue
        if pending and stripped.startswith("#"):        # a comment inside a continued instruction
            continue
        if stripped.endswith(escape):
            pending += stripped[:-1] + " "
            continue
        whole = (pending + stripped).strip()
        pending = ""
        keyword, _, arguments = whole.partition(" ")
        found.append((keyword.upper(), arguments.strip()))
    if pending:
        keyword, _, arguments = pending.strip().partition(" ")
        found.append((keyword.upper(), arguments.strip()))
    return found


def context_sources(text: str) -> set[str]:
    """Every build-context path a COPY or ADD of this Dockerfile reads, trailing slashes removed."""
    sources: set[str] = set()
    for keyword, arguments in instructions(text):
        if keyword not in COPYING:
            continue
        if "<<" in arguments:
            raise ValueError(f"{keyword} {arguments}: a heredoc, which this reader does not follow")
        flagged = re.match(r"^((?:--\S+\s+)*)(.*)$", arguments, re.DOTALL)
        flags, rest = flagged.group(1).split(), flagged.group(2).strip()
        if any(flag.startswith("--from=") for flag in flags):
            continue                         # another stage's or image's files, not the context's
        words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        *paths, _destination = words
        sources.update(p.rstrip("/") for p in paths if not (keyword == "ADD" and REMOTE.match(p)))
    return sources
