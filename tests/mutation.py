"""Mutation testing, a measure of what the suite catches: small plausible bugs put into the rooms that decide what
a user sees, one at a time; a mutant is killed when a test fails (or hangs past its timeout). Run on demand, not in
CI (docs/testing.md has the last run's table and what its survivors are):

    nice -n 10 .venv/bin/python tests/mutation.py                 # the fast tier; then the server tier's share
    nice -n 10 .venv/bin/python tests/mutation.py --room serving  # one room
    .venv/bin/python tests/mutation.py --list                     # the mutants alone

The mutants: every place in a room's sources where one of the operators below applies (comparisons, arithmetic,
boolean operators, negated conditions, constants, min/max, a statement dropped), skipping docstrings, log and
error messages and annotations; then a seeded sample of --per-room from each room, so a run tries the same mutants
as long as the code is the same. Each runs in a scratch copy of the tree (build/mutation/tree) with PYTHONPATH
pointing there, so the tritonserver stubs that server tests start import the mutant too. The fast tier runs the
room's fast test files (-m "not server", -x); a mutant that survives them runs again with the room's server-tier
files: the whole suite's share for that room (ROOMS names the files that exercise each room). Results go to
build/mutation/results.json (a rerun resumes from it; --fresh starts over); the table is printed in markdown.
After tests were added for a run's survivors, `--again` tries those survivors once more on the code as it is now
(each found by its file, operator and text, nearest its old line; gone when the code it mutated is gone), both
tiers, and prints what each came to.
"""
from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutation"
SEED = 51
PER_ROOM = 25
TEST_TIMEOUT_S = 120  # one test (pytest-timeout): a mutant that hangs a test is killed by it


@dataclass(frozen=True)
class Room:
    name: str
    sources: tuple[str, ...]  # files, or file::name for one top-level function or class
    fast: tuple[str, ...]  # the fast tier's test files that exercise it, the most direct first
    server: tuple[str, ...]  # the server tier's


ROOMS = (
    Room("api", ("backend/api/codec.py", "backend/api/contract.py", "backend/api/controls.py",
                 "backend/api/description.py", "backend/api/provenance.py", "backend/api/refusal.py",
                 "backend/api/request.py", "backend/api/settings.py"),
         ("tests/test_contract_boundaries.py", "tests/test_codec.py", "tests/test_controls.py",
          "tests/test_generated_requests.py", "tests/test_recording.py", "tests/test_docs.py",
          "tests/test_client_stream.py", "tests/test_client_camera.py", "tests/test_scheduler.py",
          "tests/test_engine_validation.py", "tests/test_fast_paths.py", "tests/test_launcher.py"),
         ("tests/test_triton_server.py", "tests/test_steering.py", "tests/test_replay.py")),
    Room("engine", ("backend/engine/blocks.py", "backend/engine/camera_track.py", "backend/engine/geometry.py",
                    "backend/engine/parts.py", "backend/engine/prompts.py", "backend/engine/rollout.py",
                    "backend/engine/session.py", "backend/engine/validation.py", "backend/engine/snapshot/store.py",
                    "backend/engine/snapshot/manifest.py"),
         ("tests/test_golden.py", "tests/test_engine_rollout.py", "tests/test_recache.py", "tests/test_prompt_events.py",
          "tests/test_snapshots.py", "tests/test_saved_worlds.py",
          "tests/test_engine_validation.py", "tests/test_recording.py", "tests/test_contract_boundaries.py",
          "tests/test_fast_paths.py", "tests/test_one_rank.py", "tests/test_intake.py", "tests/test_group_loop.py"),
         ("tests/test_engine_parallel.py", "tests/test_engine_tensor_parallel.py", "tests/test_recache.py",
          "tests/test_prompt_events.py")),
    Room("model", ("backend/model/kv_cache.py", "backend/model/rope.py", "backend/model/schedule.py",
                   "backend/model/camera.py"),
         ("tests/test_golden.py", "tests/test_model_camera.py", "tests/test_model_schedule.py",
          "tests/test_model_transformer.py", "tests/test_engine_rollout.py", "tests/test_recache.py",
          "tests/test_fast_paths.py"),
         ("tests/test_engine_parallel.py", "tests/test_recache.py")),
    Room("serving", ("backend/serving/scheduler.py", "backend/serving/waits.py", "backend/serving/admission.py",
                     "backend/serving/fair.py", "backend/serving/parks.py", "backend/serving/saves.py",
                     "backend/serving/sequences.py"),
         ("tests/test_scheduler.py", "tests/test_fair_queue.py", "tests/test_contract_boundaries.py",
          "tests/test_saved_worlds.py", "tests/test_one_rank.py", "tests/test_intake.py", "tests/test_group_loop.py",
          "tests/test_parked_worlds.py"),
         ("tests/test_group_sessions.py", "tests/test_local_group.py", "tests/test_triton_server.py",
          "tests/test_parked_worlds.py")),
    Room("client", ("client/recording.py", "client/web/app.py", "client/web/schema.py", "client/web/serve.py::access",
                    "client/world_saves.py", "client/world_stall.py", "client/world_replay.py"),
         ("tests/test_recording.py", "tests/test_web_access.py", "tests/test_generated_requests.py",
          "tests/test_world_parts.py", "tests/test_played_world_calls.py"),
         ("tests/test_replay.py", "tests/test_web_security.py", "tests/test_web_player.py")),
    Room("launch", ("backend/launch/heal.py", "backend/launch/agent.py"),
         ("tests/test_fleet_parts.py",),
         ("tests/test_fleet.py",)),
)
ROOM = {room.name: room for room in ROOMS}


@dataclass(frozen=True)
class Mutant:
    room: str
    path: str
    line: int
    col: int
    end_line: int
    end_col: int
    operator: str
    before: str
    after: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}:{self.col}:{self.operator}"

    def describe(self) -> str:
        before, after = (" ".join(t.split()) for t in (self.before, self.after))
        return f"{self.path}:{self.line} `{before[:70]}` -> `{after[:70]}`"

    def apply(self, source: str) -> str:
        lines = source.splitlines(keepends=True)
        start = sum(map(len, lines[: self.line - 1])) + _chars(lines[self.line - 1], self.col)
        end = sum(map(len, lines[: self.end_line - 1])) + _chars(lines[self.end_line - 1], self.end_col)
        return source[:start] + self.after + source[end:]


def _chars(line: str, byte_offset: int) -> int:
    """ast's column offsets count UTF-8 bytes: the character index of one."""
    return len(line.encode()[:byte_offset].decode(errors="ignore"))


# ---------------------------------------------------------------- the operators


SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
         ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
         ast.Mod: ast.FloorDiv, ast.And: ast.Or, ast.Or: ast.And}
QUIET_CALLS = {"debug", "info", "warning", "error", "exception", "print", "warn"}  # logs: not behaviour


def _quiet(node: ast.AST) -> bool:
    """A node whose text is a message: a docstring, a log call, an f-string, what a raise or an assert says."""
    if isinstance(node, (ast.JoinedStr, ast.Raise, ast.Assert)):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        return isinstance(func, ast.Attribute) and func.attr in QUIET_CALLS or isinstance(func, ast.Name) and \
            func.id in QUIET_CALLS
    return False


def _annotations(tree: ast.AST) -> set[int]:
    """ids of every node inside an annotation."""
    found: set[int] = set()
    for node in ast.walk(tree):
        for annotation in (getattr(node, "annotation", None), getattr(node, "returns", None)):
            if annotation is not None:
                found |= {id(n) for n in ast.walk(annotation)}
    return found


def _candidates(node: ast.AST) -> Iterator[tuple[str, ast.AST, str]]:
    """(operator, the node to replace, its replacement's text) for one node."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in SWAPS:
                new = copy.deepcopy(node)
                new.ops[i] = SWAPS[type(op)]()
                yield f"compare{i}", node, ast.unparse(new)
    elif isinstance(node, ast.BinOp) and type(node.op) in SWAPS and _text_operand(node):
        return  # a string or a path joined: another operator is a type error, not a plausible bug
    elif isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in SWAPS:
        new = copy.deepcopy(node)
        new.op = SWAPS[type(node.op)]()
        yield "operator", node, ast.unparse(new)
    elif isinstance(node, ast.AugAssign) and type(node.op) in SWAPS:
        new = copy.deepcopy(node)
        new.op = SWAPS[type(node.op)]()
        yield "augmented", node, ast.unparse(new)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        yield "unary", node, ast.unparse(node.operand)
    elif isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
        value = node.value
        yield "constant", node, repr(not value if isinstance(value, bool) else value + 1 if isinstance(value, int)
                                     else value * 2 if value else 1.0)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
        new = copy.deepcopy(node)
        new.func.id = "max" if node.func.id == "min" else "min"
        yield "min-max", node, ast.unparse(new)
    if isinstance(node, (ast.If, ast.While, ast.IfExp)) and not _negated_anyway(node.test):
        yield "negate", node.test, f"not ({ast.unparse(node.test)})"
    if _state_change(node):
        yield "drop", node, "pass"


def _text_operand(node: ast.BinOp) -> bool:
    return any(isinstance(side, ast.JoinedStr) or isinstance(side, ast.Constant) and isinstance(side.value, str)
               for side in (node.left, node.right))


def _negated_anyway(test: ast.expr) -> bool:
    """A condition another operator negates already: `not x` (unary), `a == b`, `a is b`, `a in b` (compare)."""
    return isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) or isinstance(test, ast.Compare) and \
        len(test.ops) == 1 and type(test.ops[0]) in (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn)


def _state_change(node: ast.AST) -> bool:
    """A statement whose loss is a plausible bug: a call for its effect (not a log), an augmented assignment, an
    assignment to an attribute or an item (a local name's would only leave it undefined)."""
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Call) and not _quiet(node.value)
    if isinstance(node, ast.Assign):
        return all(isinstance(t, (ast.Attribute, ast.Subscript)) for t in node.targets)
    return isinstance(node, ast.AugAssign) and isinstance(node.target, (ast.Attribute, ast.Subscript))


def _inside(tree: ast.AST, name: str | None) -> ast.AST:
    if name is None:
        return tree
    return next(n for n in tree.body if getattr(n, "name", None) == name)


BLOCKS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.If, ast.For, ast.While, ast.With, ast.Try, ast.ExceptHandler)


def mutants_of(room: Room) -> list[Mutant]:
    found = []
    for source in room.sources:
        path, _, name = source.partition("::")
        text = (ROOT / path).read_text()
        tree = ast.parse(text)
        scope = _inside(tree, name or None)
        skip = _annotations(tree)
        quiet: set[int] = set()
        parents: dict[int, ast.AST] = {}
        for node in ast.walk(scope):
            for child in ast.iter_child_nodes(node):
                parents[id(child)] = node
            if _quiet(node):
                quiet |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(scope):
            if id(node) in skip or id(node) in quiet or not hasattr(node, "lineno"):
                continue
            for operator, target, after in _candidates(node):
                if operator == "drop" and not isinstance(parents.get(id(node)), BLOCKS):
                    continue  # a module's or a class's statement: its name would be missing (an import error)
                before = ast.get_source_segment(text, target) or ""
                found.append(Mutant(room.name, path, target.lineno, target.col_offset, target.end_lineno,
                                    target.end_col_offset, operator, before, after))
    return [m for m in found if _valid(m)]


def _valid(mutant: Mutant) -> bool:
    """A mutant that parses and changes the program (not only its text)."""
    source = (ROOT / mutant.path).read_text()
    try:
        return ast.dump(ast.parse(mutant.apply(source))) != ast.dump(ast.parse(source))
    except SyntaxError:
        return False


def sample(room: Room, per_room: int) -> list[Mutant]:
    everything = mutants_of(room)
    chosen = random.Random(f"{SEED}-{room.name}").sample(everything, min(per_room, len(everything)))
    return sorted(chosen, key=lambda m: (m.path, m.line, m.col, m.operator))


# ---------------------------------------------------------------- running them


def scratch_tree() -> Path:
    """A copy of the tree's tracked and untracked files (not ignored ones), with the venv beside it."""
    tree = WORK / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tree / name)
    (tree / ".venv").symlink_to(ROOT / ".venv")
    return tree


@dataclass
class Outcome:
    killed: bool
    seconds: float
    why: str  # the first failing test, "timeout", or "" for a survivor


def run_tests(tree: Path, files: tuple[str, ...], tier: str, limit_s: float) -> Outcome:
    """The files' tests (-x) in the scratch tree; killed when one fails or errors, or when they outrun limit_s."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--timeout={TEST_TIMEOUT_S}",
               "-m", "not server" if tier == "fast" else "server", *files]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tree), str(tree / "tests")]), "LINGBOT_REQUIRE_TOOLS": "0"}
    began = time.monotonic()
    process = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True, text=True)
    try:
        output, _ = process.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return Outcome(True, time.monotonic() - began, "timeout")
    seconds = time.monotonic() - began
    if process.returncode == 0:
        return Outcome(False, seconds, "")
    if process.returncode == 5:  # nothing collected: a mapping with no test of this tier
        return Outcome(False, seconds, "no tests")
    failed = [line.split(" ")[1] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return Outcome(True, seconds, failed[0] if failed else f"exit {process.returncode}")


def baseline(tree: Path, room: Room, tier: str) -> tuple[tuple[str, ...], float]:
    """The room's test files on the unmutated tree, each on its own: they must pass. Returns them fastest first
    (a mutant's run stops at its first failure, so the quick files go first) and their time in all, which bounds
    a mutant's run."""
    seconds = {}
    for name in room.fast if tier == "fast" else room.server:
        outcome = run_tests(tree, (name,), tier, 3600)
        if outcome.killed:
            raise SystemExit(f"{room.name}: {name} fails without a mutant ({outcome.why}): fix that first")
        seconds[name] = outcome.seconds
    print(f"{room.name}: {tier} tier baseline {sum(seconds.values()):.0f} s "
          f"({', '.join(f'{Path(n).stem} {t:.0f} s' for n, t in seconds.items())})", flush=True)
    return tuple(sorted(seconds, key=seconds.get)), sum(seconds.values())


def bound_s(baseline_s: float) -> float:
    """How long a mutant's run may take: three times the unmutated files' time, and a minute."""
    return 3 * baseline_s + 60


def try_mutant(tree: Path, mutant: Mutant, files: tuple[str, ...], tier: str, limit_s: float) -> Outcome:
    target = tree / mutant.path
    original = target.read_text()
    target.write_text(mutant.apply(original))
    try:
        return run_tests(tree, files, tier, limit_s)
    finally:
        target.write_text(original)


def run(rooms: list[Room], per_room: int, tiers: list[str], results_path: Path) -> dict[str, dict]:
    results: dict[str, dict] = json.loads(results_path.read_text()) if results_path.exists() else {}
    tree = scratch_tree()
    for room in rooms:
        mutants = sample(room, per_room)
        for tier in tiers:
            todo = [m for m in mutants if tier not in results.get(m.id, {})
                    and (tier == "fast" or not results[m.id]["fast"]["killed"])]
            if not todo:
                continue
            files, seconds = baseline(tree, room, tier)
            limit_s = bound_s(seconds)
            for n, mutant in enumerate(todo, 1):
                outcome = try_mutant(tree, mutant, files, tier, limit_s)
                results.setdefault(mutant.id, {"mutant": asdict(mutant)})[tier] = asdict(outcome)
                results_path.write_text(json.dumps(results, indent=1))
                verdict = f"killed by {outcome.why}" if outcome.killed else "SURVIVED"
                print(f"[{room.name} {tier} {n}/{len(todo)} {outcome.seconds:.0f} s] {mutant.describe()}: {verdict}",
                      flush=True)
    return results


def survivors(rows: Iterable[dict]) -> list[Mutant]:
    """The mutants of these results that no tier killed."""
    return [Mutant(**r["mutant"]) for r in rows if not r["fast"]["killed"] and not r.get("server", {}).get("killed")]


def found_again(old: Mutant) -> Mutant | None:
    """The same mutation in the code as it is now: same file, operator and text, the nearest line to the old one
    (then the nearest column)."""
    same = [m for m in mutants_of(ROOM[old.room]) if (m.path, m.operator, m.before, m.after) ==
            (old.path, old.operator, old.before, old.after)]
    return min(same, key=lambda m: (abs(m.line - old.line), abs(m.col - old.col)), default=None)


def again(results: dict[str, dict]) -> list[str]:
    """Each survivor of `results` tried once more on the current code, fast tier then server tier."""
    tree, lines, baselines = scratch_tree(), [], {}
    for old in survivors(results.values()):
        mutant = found_again(old)
        if mutant is None:
            lines.append(f"- {old.describe()}: gone (the code it mutated changed)")
            continue
        room = ROOM[mutant.room]
        for tier in ("fast", "server"):
            if (room.name, tier) not in baselines:
                baselines[room.name, tier] = baseline(tree, room, tier)
            files, seconds = baselines[room.name, tier]
            outcome = try_mutant(tree, mutant, files, tier, bound_s(seconds))
            if outcome.killed:
                break
        verdict = f"killed by {outcome.why} ({tier} tier)" if outcome.killed else "SURVIVED"
        lines.append(f"- {mutant.describe()}: {verdict}")
        print(lines[-1], flush=True)
    return lines


def table(results: dict[str, dict], rooms: list[Room], per_room: int) -> str:
    """Per room: mutants tried, killed by the fast tier, by the whole suite (fast, then server tier), survivors."""
    lines = ["| room | mutants | killed, fast tier | killed, whole suite | survivors |", "|---|--:|--:|--:|---|"]
    totals = [0, 0, 0]
    survived = []
    for room in rooms:
        rows = [results[m.id] for m in sample(room, per_room) if m.id in results and "fast" in results[m.id]]
        fast = sum(r["fast"]["killed"] for r in rows)
        whole = fast + sum(r.get("server", {}).get("killed", False) for r in rows if not r["fast"]["killed"])
        left = survivors(rows)
        survived += left
        totals = [totals[0] + len(rows), totals[1] + fast, totals[2] + whole]
        lines.append(f"| {room.name} | {len(rows)} | {fast} ({_pct(fast, len(rows))}) | {whole} "
                     f"({_pct(whole, len(rows))}) | {len(left)} |")
    lines.append(f"| all | {totals[0]} | {totals[1]} ({_pct(totals[1], totals[0])}) | {totals[2]} "
                 f"({_pct(totals[2], totals[0])}) | {totals[0] - totals[2]} |")
    lines += ["", "Survivors:", *[f"- {m.room}: {m.describe()} ({m.operator})" for m in survived]]
    return "\n".join(lines)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--room", action="append", choices=sorted(ROOM), help="only these rooms (repeatable)")
    parser.add_argument("--per-room", type=int, default=PER_ROOM, help="mutants sampled per room (%(default)s)")
    parser.add_argument("--tier", choices=["fast", "whole"], default="whole",
                        help="fast: the fast tier only; whole: then the server tier for its survivors")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--fresh", action="store_true", help="forget earlier results")
    parser.add_argument("--results", type=Path, default=WORK / "results.json")
    parser.add_argument("--again", action="store_true", help="try the survivors in --results again on this code")
    args = parser.parse_args(argv)
    rooms = [ROOM[name] for name in args.room] if args.room else list(ROOMS)
    if args.list:
        for room in rooms:
            mutants = sample(room, args.per_room)
            print(f"{room.name}: {len(mutants)} of {len(mutants_of(room))} candidates")
            print("\n".join(f"  {m.describe()} ({m.operator})" for m in mutants))
        return 0
    WORK.mkdir(parents=True, exist_ok=True)
    if args.again:
        print("\n".join(again(json.loads(args.results.read_text()))))
        return 0
    if args.fresh and args.results.exists():
        args.results.unlink()
    results = run(rooms, args.per_room, ["fast"] if args.tier == "fast" else ["fast", "server"], args.results)
    print(table(results, rooms, args.per_room))
    return 0


if __name__ == "__main__":
    sys.exit(main())
