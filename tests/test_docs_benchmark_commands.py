"""Every benchmark command the README and docs print beside a figure is one its script still accepts (issue 28).

A figure is only reproducible while the command beside it parses: a renamed or removed flag, a dropped choice or
a script folded into another would otherwise leave the docs naming a command that fails. Each
``python benchmarks/<name>.py ...`` in a shell block or an inline code span of README.md and docs/**/*.md is run,
in one subprocess, as ``__main__`` with its argv up to the point where its argument parser returns: the parser
(every ``argparse.ArgumentParser.parse_args`` call) accepts the flags, their types and choices, and nothing is
trained or measured. Shell variables assigned in the same block (``B=path``) are substituted; comments, line
continuations and what follows a shell operator are dropped.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from helpers.processes import REPO, clean_env
from test_docs_snippets import SNIPPETS, markdown_files

SCRIPT = re.compile(r"^(?:\S*/)?benchmarks/(\w+)\.py$")
INLINE = re.compile(r"`(python3? benchmarks/[^`]+)`")
SHELL_OPS = {"&&", "||", ";", "|", ">", ">>", "2>&1", "&"}


def commands_of_line(line: str, env: dict[str, str]) -> list[list[str]]:
    """The ``[script, *argv]`` of each benchmark run in one shell line (variables of ``env`` substituted)."""
    for k, v in env.items():
        line = line.replace(f"${{{k}}}", v).replace(f"${k}", v)
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return []
    out = []
    for i, tok in enumerate(tokens):
        m = SCRIPT.match(tok)
        if m and i > 0 and Path(tokens[i - 1]).name.startswith("python"):
            argv = []
            for t in tokens[i + 1:]:
                if t in SHELL_OPS:
                    break
                argv.append(t)
            out.append([m.group(1), *argv])
    return out


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, [script, *argv]) for every benchmark command of the shell blocks and inline code spans."""
    found = []
    for s in SNIPPETS:
        if s.lang not in ("bash", "sh", "console"):
            continue
        env: dict[str, str] = {}
        for line in s.code.replace("\\\n", " ").splitlines():
            assign = re.fullmatch(r"\s*([A-Z_][A-Z0-9_]*)=(.*)", line)
            if assign:  # NAME=value or NAME="a value": what $NAME then expands to
                env[assign.group(1)] = " ".join(shlex.split(assign.group(2), comments=True))
                continue
            found += [(s.id, cmd) for cmd in commands_of_line(line, env)]
    for path in markdown_files():
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # fenced blocks: above
        for m in INLINE.finditer(text):
            line_no = text[:m.start()].count("\n") + 1
            found += [(f"{path.relative_to(REPO)}:~{line_no}", cmd) for cmd in commands_of_line(m.group(1), {})]
    return found


RUNNER = r"""
import argparse, contextlib, io, json, os, runpy, sys
class Parsed(Exception):
    pass
original = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    original(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = parse_args
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
results = []
for where, (name, *argv) in json.load(sys.stdin):
    sys.argv = [f"benchmarks/{name}.py", *argv]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(sys.argv[0], run_name="__main__")
        results.append([where, " ".join(sys.argv), "ran to the end without parsing its arguments"])
    except Parsed:
        results.append([where, " ".join(sys.argv), None])
    except SystemExit as e:
        results.append([where, " ".join(sys.argv), f"exit {e.code}: {err.getvalue()[-600:]}"])
    except Exception as e:
        results.append([where, " ".join(sys.argv), f"{type(e).__name__} before its parser returned: {e}"])
print(json.dumps(results))
"""


def test_the_docs_name_benchmark_commands():
    cmds = documented_commands()
    scripts = {cmd[0] for _, cmd in cmds}
    assert len(cmds) >= 20 and {"time_to_accuracy", "iteration_time", "timeline", "paper_table"} <= scripts
    missing = [f"{where}: benchmarks/{cmd[0]}.py" for where, cmd in cmds
               if not (REPO / "benchmarks" / f"{cmd[0]}.py").is_file()]
    assert not missing, "documented benchmark scripts that do not exist:\n" + "\n".join(missing)
    # the recorded results a command starts from (--baselines-from a.json,b.json, --plot-from) are committed
    inputs = [(where, path) for where, cmd in cmds for flag, value in zip(cmd, cmd[1:], strict=False)
              if flag in ("--baselines-from", "--plot-from") for path in value.split(",")]
    assert inputs, "no documented command reads recorded results: the extraction is broken"
    gone = [f"{where}: {path}" for where, path in inputs if not (REPO / path).is_file()]
    assert not gone, "recorded results that documented commands read, missing:\n" + "\n".join(gone)


def test_every_documented_benchmark_command_parses():
    cmds = documented_commands()
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(cmds), cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(cmds)
    bad = [f"{where}: {cmd}\n    {why}" for where, cmd, why in results if why]
    assert not bad, "documented benchmark commands their scripts refuse:\n" + "\n".join(bad)


def test_the_command_extraction_itself():
    env = {"B": "benchmarks/results/x.json"}
    line = "python benchmarks/time_to_accuracy.py --seeds 0 --baselines-from $B --candidates '{\"a\": {}}' # note"
    assert commands_of_line(line, env) == [["time_to_accuracy", "--seeds", "0", "--baselines-from",
                                            "benchmarks/results/x.json", "--candidates", '{"a": {}}']]
    assert commands_of_line(".venv/bin/python benchmarks/soak.py --steps 10 && echo done", {}) == [
        ["soak", "--steps", "10"]]
    assert commands_of_line("cat benchmarks/soak.py", {}) == []  # not a run
    assert commands_of_line("$T --workloads gpt2 --budget 8   # 80 steps", {"T": "python benchmarks/x.py --a b"}) == [
        ["x", "--a", "b", "--workloads", "gpt2", "--budget", "8"]]
