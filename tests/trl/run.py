"""TRL's own trainer tests as the measure of instruct_goose's drop-in trainers (`make test-trl`, not part of `make test`).

For each of TRL's five trainer test files (GRPO, RLOO, DPO, reward, SFT) this runs the file twice, with the same
pytest, the same offline stand-ins for the Hub (make_standins.py) and the same TRL helpers:

  (a) on TRL itself, as TRL's repository has it;
  (b) on instruct_goose: a copy in which only the line `from trl import XConfig, XTrainer` reads
      `from instruct_goose import XConfig, XTrainer` (TRL's collators, utilities and helpers stay TRL's).

Every test that passes on TRL is then classified by what it does here: passes / refused on purpose (our trainer
raises an error naming the unsupported feature: REFUSAL_PATTERNS) / pokes TRL internals (INTERNALS, by name with the
reason) / failing. results.md gets the counts and the failing tests grouped by their first error line.

The tests are TRL's (Apache-2.0, (c) The HuggingFace Team): they are not committed here. `--trl-src` names a TRL git
repository (bare or not) or a source tree; its tests/ and scripts/generate_zen_dataset.py are copied into
tests/trl/upstream/ (gitignored), at the tag of the installed TRL's version when the repository has it, otherwise
at `--rev` (recorded in upstream/SOURCE and in results.md). Names the installed TRL lacks that a copied file imports
from `trl` are stubbed in the copies (a call raises ImportError, an `is_*_available` says False), so one missing
name fails only the tests that use it, on both sides alike.

    python tests/trl/run.py --trl-src ~/src/trl                  # all five files
    python tests/trl/run.py --trl-src ~/src/trl --files grpo --every 3
"""

import argparse
import ast
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
UPSTREAM = HERE / "upstream"
WORK = REPO / ".trl-standins"

FILES = {  # short name: (test file, config, trainer)
    "grpo": ("test_grpo_trainer.py", "GRPOConfig", "GRPOTrainer"),
    "rloo": ("test_rloo_trainer.py", "RLOOConfig", "RLOOTrainer"),
    "dpo": ("test_dpo_trainer.py", "DPOConfig", "DPOTrainer"),
    "reward": ("test_reward_trainer.py", "RewardConfig", "RewardTrainer"),
    "sft": ("test_sft_trainer.py", "SFTConfig", "SFTTrainer"),
}
HELPERS = ["__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py"]

# An error whose message matches one of these is a deliberate refusal: the trainer names the feature it does not run.
REFUSAL_PATTERNS = [
    r"is not supported",
    r"not supported yet",
    r"\brefused\b",
    r"\brefuses\b",
    r"NotYet",  # NotImplementedError subclasses named *NotYet, and the *NotYet config fields
    r"does not run here",
    r"vLLM does not run",
]

# Tests that read or patch TRL's private trainer internals (attributes and methods TRL's tests reach into, which a
# drop-in need not have): name (without the parameters) -> the internal it pokes. Kept by hand from the sources of the
# tests that pass on TRL and fail here (see `internals_hints`, which lists the candidates in results.md).
INTERNALS = {
    # GRPO
    "test_compute_entropy_mask_0": "calls TRL's `GRPOTrainer.get_high_entropy_mask` unbound on a Mock(spec=GRPOTrainer) "
    "with TRL's accelerator attributes",
    "test_compute_entropy_threshold_0": "calls TRL's `GRPOTrainer.get_high_entropy_mask` unbound on a Mock(spec=GRPOTrainer)",
    "test_get_off_policy_mask_padding": "calls TRL's `GRPOTrainer.get_off_policy_mask` (a TRL helper method)",
    "test_warning_raised_sequence_level_with_token_summed_loss": "asserts a warning on TRL's logger "
    "'trl.trainer.grpo_trainer' (caplog)",
}

# messages that say the test needed a Hub repository this machine has no stand-in for
MISSING_STANDIN = re.compile(
    r"OfflineModeIsEnabled|LocalEntryNotFoundError|offline mode|couldn't connect|"
    r"is not cached|Cannot find the requested files|not a local folder and is not a valid "
    r"model identifier|We couldn't connect|Couldn't find cache for|not cached in|"
    r"outgoing traffic has been disabled",
    re.I,
)


def sh(*args, **kw):
    return subprocess.run(args, check=True, text=True, capture_output=True, **kw).stdout


# ---------------------------------------------------------------------------------------------------------------
# 1. the upstream files
# ---------------------------------------------------------------------------------------------------------------


def fetch_upstream(trl_src: Path, rev: str) -> str:
    "Copy TRL's tests (and the zen data set's generator) into upstream/; returns a line saying from where."
    import trl

    names = (
        [f"tests/{f}" for f, _, _ in FILES.values()]
        + [f"tests/{h}" for h in HELPERS]
        + ["tests/data", "scripts/generate_zen_dataset.py", "LICENSE"]
    )
    if UPSTREAM.exists():
        for p in UPSTREAM.iterdir():
            if p.name != "README.md":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    UPSTREAM.mkdir(exist_ok=True)
    git = None
    if (trl_src / "HEAD").exists() and (trl_src / "objects").is_dir():
        git = ["git", "--git-dir", str(trl_src)]
    elif (trl_src / ".git").exists():
        git = ["git", "-C", str(trl_src)]
    if git:
        tag = f"v{trl.__version__}"
        tags = set(sh(*git, "tag", "--list", tag).split())
        use = tag if tag in tags else rev
        commit = sh(*git, "rev-parse", f"{use}^{{commit}}").strip()
        date = sh(*git, "log", "-1", "--format=%ci", commit).strip()
        try:
            version = sh(*git, "show", f"{commit}:VERSION").strip()
        except subprocess.CalledProcessError:
            version = "?"
        archive = subprocess.run([*git, "archive", commit, *names], check=True, capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", str(UPSTREAM)], input=archive, check=True)
        source = f"TRL git {use} = {commit} ({date}, VERSION {version})" + (
            "" if use == tag else f"; the repository has no tag {tag} (the installed TRL {trl.__version__})"
        )
    else:
        for n in names:
            src = trl_src / n
            if not src.exists():
                continue
            dst = UPSTREAM / n
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
        source = f"TRL source tree {trl_src} (not a git repository: revision unknown)"
    # flatten: upstream/tests/* -> upstream/*
    for p in (UPSTREAM / "tests").iterdir():
        p.rename(UPSTREAM / p.name)
    (UPSTREAM / "tests").rmdir()
    (UPSTREAM / "SOURCE").write_text(source + "\n")
    return source


# ---------------------------------------------------------------------------------------------------------------
# 2. the two copies
# ---------------------------------------------------------------------------------------------------------------

SHIM = '''"Stand-ins for names the copied tests import from `trl` that the installed TRL lacks (written by tests/trl/run.py)."


def trl_missing(qualname):
    if qualname.rsplit(".", 1)[-1].startswith("is_") and qualname.endswith("_available"):
        return lambda *a, **k: False
    def missing(*args, **kwargs):
        raise ImportError(f"{qualname} is not in the installed TRL (the tests are from another TRL revision)")
    missing.__name__ = qualname.rsplit(".", 1)[-1]
    return missing
'''


def guard_trl_imports(source: str) -> tuple[str, list[str]]:
    "Rewrite `from trl... import a, b` statements whose names the installed TRL lacks; returns (source, the missing)."
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits, missing_all = [], []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and (node.module == "trl" or node.module.startswith("trl."))
        ):
            continue
        try:
            mod = importlib.import_module(node.module)
        except ImportError:
            mod = None
        present = [a for a in node.names if mod is not None and hasattr(mod, a.name)]
        missing = [a for a in node.names if a not in present]
        if not missing:
            continue
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        new = []
        if present:
            new.append(
                f"{indent}from {node.module} import "
                + ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in present)
                + "\n"
            )
        new.append(f"{indent}from .trl_shim import trl_missing as _trl_missing\n")
        for a in missing:
            new.append(
                f"{indent}{a.asname or a.name} = _trl_missing({node.module + '.' + a.name!r})  "
                f"# not in the installed TRL\n"
            )
            missing_all.append(f"{node.module}.{a.name}")
        edits.append((node.lineno, node.end_lineno, new))
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1 : end] = new
    return "".join(lines), missing_all


def swap_trainer_import(source: str, config: str, trainer: str) -> str:
    "The one change of the instruct_goose copy: the trainer and its config come from instruct_goose."
    pattern = re.compile(rf"^from trl import {config}, {trainer}$", re.M)
    assert len(pattern.findall(source)) == 1, f"no single `from trl import {config}, {trainer}` line"
    return pattern.sub(
        f"from instruct_goose import {config}, {trainer}  # the one line changed from TRL's test", source
    )


PYTEST_INI = """[pytest]
# TRL's own markers (its pyproject.toml); `make test` there deselects slow and low_priority
markers =
    slow: marks tests as slow
    low_priority: marks tests as low priority
    invariant: training-invariant checks
addopts = -m "not slow and not low_priority"
"""


def prepare(side: str) -> tuple[Path, list[str]]:
    "`.trl-standins/run/<side>/tests/`: the upstream files, import-guarded, and for `goose` the trainers swapped."
    root = WORK / "run" / side
    shutil.rmtree(root, ignore_errors=True)
    pkg = root / "tests"
    pkg.mkdir(parents=True)
    (root / "pytest.ini").write_text(PYTEST_INI)
    (pkg / "trl_shim.py").write_text(SHIM)
    if (UPSTREAM / "data").is_dir():
        shutil.copytree(UPSTREAM / "data", pkg / "data")
    missing = []
    for name in HELPERS + [f for f, _, _ in FILES.values()]:
        src = UPSTREAM / name
        if not src.exists():
            continue
        text, miss = guard_trl_imports(src.read_text(encoding="utf-8"))
        missing += miss
        for f, config, trainer in FILES.values():
            if name == f and side == "goose":
                text = swap_trainer_import(text, config, trainer)
        (pkg / name).write_text(text, encoding="utf-8")
    return root, sorted(set(missing))


# ---------------------------------------------------------------------------------------------------------------
# 3. running and reading
# ---------------------------------------------------------------------------------------------------------------


def collect(root: Path, test_file: str, env) -> list[str]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            f"tests/{test_file}",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "--confcutdir",
            str(root),
        ],
        cwd=root,
        env=env,
        text=True,
        capture_output=True,
    ).stdout
    return [l.strip() for l in out.splitlines() if "::" in l and not l.startswith(" ")]


def select(ids: list[str], every: int, first: int | None) -> list[str]:
    ids = ids[::every] if every > 1 else ids
    return ids[:first] if first else ids


def run_pytest(
    root: Path, test_file: str, ids: list[str] | None, env, timeout: int, tag: str
) -> tuple[Path, float]:
    xml = WORK / "reports" / f"{tag}.xml"
    log = WORK / "reports" / f"{tag}.log"
    xml.parent.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--confcutdir",
        str(root),
        "-q",
        "-rN",
        f"--timeout={timeout}",
        f"--junitxml={xml}",
        "-o",
        "junit_family=xunit1",
        "-W",
        "ignore::DeprecationWarning",
    ]
    if ids is None:
        args.append(f"tests/{test_file}")
    else:
        args += ids
    t0 = time.time()
    with open(log, "w") as fh:
        subprocess.run(args, cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT)
    return xml, time.time() - t0


def read_junit(xml: Path) -> dict[str, dict]:
    "nodeid -> {outcome: passed|failed|error|skipped, message, text, time}."
    results = {}
    if not xml.exists():
        return results
    for case in ET.parse(xml).getroot().iter("testcase"):
        cls = case.get("classname", "")
        parts = cls.split(".")
        # classname is tests.test_x.TestY (or tests.test_x for a function)
        file = "/".join(parts[:2]) + ".py" if len(parts) >= 2 else cls
        nodeid = "::".join([file] + parts[2:] + [case.get("name")])
        outcome, message, text = "passed", "", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                if child.tag == "error" and outcome == "failed":
                    continue  # a teardown error after a failure
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message, text = child.get("message", "") or "", child.text or ""
        prev = results.get(nodeid)
        if prev and prev["outcome"] in ("failed", "error") and outcome == "passed":
            continue
        results[nodeid] = dict(
            outcome=outcome, message=message, text=text, time=float(case.get("time", 0) or 0)
        )
    return results


def first_error(r: dict) -> str:
    "The first line that says what went wrong: the exception line of the message (or the traceback's last E line)."
    msg = (r["message"] or "").strip()
    if not msg:
        elines = [l[1:].strip() for l in r["text"].splitlines() if l.startswith("E ")]
        msg = elines[0] if elines else r["text"].strip().splitlines()[-1] if r["text"].strip() else "?"
    return msg.splitlines()[0][:300]


def group_key(msg: str) -> str:
    "Messages that differ only in numbers, quoted values or object addresses group together."
    msg = re.sub(r"0x[0-9a-f]+", "0x…", msg)
    # quoted values, except bare names (an attribute, a class, a keyword: what tells two causes apart)
    msg = re.sub(r"'(?![A-Za-z_]\w*')[^']{0,80}'|\"(?![A-Za-z_]\w*\")[^\"]{0,80}\"", "'…'", msg)
    msg = re.sub(r"(?<![\w.])-?\d+(\.\d+)?(e-?\d+)?", "N", msg)
    msg = re.sub(r"tensor\(.*", "tensor(…)", msg)
    return msg[:160]


def base_name(nodeid: str) -> str:
    return nodeid.split("::")[-1].split("[")[0]


def internals_hints(src: str, name: str) -> list[str]:
    "The TRL internals a test's source reaches into (candidates for INTERNALS)."
    m = re.search(rf"\n    def {re.escape(name)}\(.*?(?=\n    def |\n    @|\nclass |\Z)", src, re.S)
    body = m.group(0) if m else ""
    hints = set(re.findall(r"trainer\._[A-Za-z]\w*", body))
    hints |= {
        f"patch.object({x})"
        for x in re.findall(r"patch\.object\(\s*([A-Za-z_][\w.]*\s*,\s*[\"'][\w]+[\"'])", body)
    }
    hints |= {f"patch({x})" for x in re.findall(r"patch\(\s*[\"']((?:trl|transformers)\.[\w.]+)[\"']", body)}
    hints |= set(re.findall(r"logger=[\"'](trl\.[\w.]+)[\"']", body))
    return sorted(hints)


def classify(trl_res: dict, goose_res: dict) -> dict[str, list]:
    cats = defaultdict(list)
    for nodeid, r in trl_res.items():
        if r["outcome"] == "skipped":
            cats["skip_trl"].append(nodeid)
            continue
        if r["outcome"] != "passed":
            cats[
                "nostandin_trl" if MISSING_STANDIN.search(r["message"] + r["text"][-3000:]) else "fail_trl"
            ].append(nodeid)
            continue
        g = goose_res.get(nodeid)
        if g is None:
            cats["failing"].append((nodeid, "not run here (the instruct_goose copy did not report it)"))
            continue
        if g["outcome"] == "passed":
            cats["pass"].append(nodeid)
            continue
        msg = first_error(g) if g["outcome"] != "skipped" else f"skipped here: {g['message']}"
        blob = g["message"] + "\n" + "\n".join(l for l in g["text"].splitlines() if l.startswith("E "))
        if base_name(nodeid) in INTERNALS:
            cats["internals"].append((nodeid, INTERNALS[base_name(nodeid)]))
        elif g["outcome"] != "skipped" and any(re.search(p, blob) for p in REFUSAL_PATTERNS):
            cats["refused"].append((nodeid, msg))
        else:
            cats["failing"].append((nodeid, msg))
    return cats


# ---------------------------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--trl-src",
        type=Path,
        default=os.environ.get("TRL_SRC"),
        help="TRL git repository or source tree (default $TRL_SRC; not needed once upstream/ is filled)",
    )
    ap.add_argument(
        "--rev",
        default="HEAD",
        help="the revision to take when the repository has no tag of the installed TRL",
    )
    ap.add_argument("--files", default="grpo,rloo,dpo,reward,sft")
    ap.add_argument("--sides", default="trl,goose")
    ap.add_argument(
        "--every", type=int, default=1, help="run every k-th collected test (a deterministic subset)"
    )
    ap.add_argument("--first", type=int, default=None, help="then the first N of those")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    ap.add_argument(
        "--report-only", action="store_true", help="classify the reports already in .trl-standins/reports"
    )
    ap.add_argument("--results", type=Path, default=HERE / "results.md")
    args = ap.parse_args(argv)
    files = args.files.split(",")

    import trl

    if args.trl_src:
        source = fetch_upstream(args.trl_src.expanduser().resolve(), args.rev)
    elif (UPSTREAM / "SOURCE").exists():
        source = (UPSTREAM / "SOURCE").read_text().strip()
    else:
        raise SystemExit("tests/trl/upstream/ is empty: give --trl-src (a TRL git repository) or set TRL_SRC")

    hf = WORK / "hf"
    if not args.report_only:
        subprocess.run(
            [sys.executable, str(HERE / "make_standins.py"), "--trl-src", str(UPSTREAM), "--out", str(hf)],
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    # upstream/ keeps scripts/generate_zen_dataset.py where make_standins reads it
    env = {
        **os.environ,
        "HF_HOME": str(hf),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
        "PYTHONPATH": str(REPO),
        "HF_DATASETS_CACHE": str(WORK / "datasets-cache"),
    }
    roots, missing = {}, set()
    for side in ("trl", "goose"):
        if args.report_only:
            roots[side] = WORK / "run" / side
            for name in HELPERS + [f for f, _, _ in FILES.values()]:
                if (UPSTREAM / name).exists():
                    missing |= set(guard_trl_imports((UPSTREAM / name).read_text())[1])
            continue
        roots[side], miss = prepare(side)
        missing |= set(miss)
    state_path = WORK / "reports" / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    for short in [] if args.report_only else files:
        test_file = FILES[short][0]
        ids = collect(roots["trl"], test_file, env)
        chosen = select(ids, args.every, args.first)
        subset = None if len(chosen) == len(ids) else chosen
        info = state.setdefault(short, {})
        info.update(collected=len(ids), selected=len(chosen), every=args.every, first=args.first)
        for side in args.sides.split(","):
            if args.report_only:
                continue
            # a fresh data set cache each run: the tests' `map` caches land there, not next to the stand-ins
            shutil.rmtree(env["HF_DATASETS_CACHE"], ignore_errors=True)
            shutil.copytree(hf / "datasets", env["HF_DATASETS_CACHE"])
            run_ids = subset
            if side == "goose" and (WORK / "reports" / f"{short}-trl.xml").exists():
                # only what passes on TRL is measured: the rest need not run here
                trl_res = read_junit(WORK / "reports" / f"{short}-trl.xml")
                run_ids = [i for i in chosen if trl_res.get(i, {}).get("outcome") == "passed"]
            n = len(chosen) if run_ids is None else len(run_ids)
            print(f"== {short} on {side}: {n} of {len(ids)} tests", flush=True)
            if n == 0:
                continue
            xml, secs = run_pytest(roots[side], test_file, run_ids, env, args.timeout, f"{short}-{side}")
            info[f"{side}_seconds"] = round(secs)
            print(f"   {secs / 60:.1f} min", flush=True)
        state_path.parent.mkdir(parents=True, exist_ok=True)
        state_path.write_text(json.dumps(state, indent=1))
    write_results(
        files if not args.report_only else [f for f in FILES if f in state],
        state,
        source,
        missing,
        args.results,
        trl.__version__,
    )


def write_results(files, state, source, missing, out: Path, trl_version: str):
    import instruct_goose

    rows, failing_all, refused_all, notes = [], [], [], []
    for short in files:
        trl_res = read_junit(WORK / "reports" / f"{short}-trl.xml")
        goose_res = read_junit(WORK / "reports" / f"{short}-goose.xml")
        if not trl_res:
            continue
        c = classify(trl_res, goose_res)
        info = state.get(short, {})
        ok = len(c["pass"]) + len(c["refused"]) + len(c["internals"]) + len(c["failing"])
        rows.append(
            (
                short,
                info.get("collected", len(trl_res)),
                len(trl_res),
                ok,
                len(c["pass"]),
                len(c["refused"]),
                len(c["internals"]),
                len(c["failing"]),
                len(c["skip_trl"]),
                len(c["nostandin_trl"]),
                len(c["fail_trl"]),
                info.get("trl_seconds"),
                info.get("goose_seconds"),
                info,
            )
        )
        src = (
            (UPSTREAM / FILES[short][0]).read_text(encoding="utf-8")
            if (UPSTREAM / FILES[short][0]).exists()
            else ""
        )
        for nodeid, msg in c["failing"]:
            failing_all.append((short, nodeid, msg, internals_hints(src, base_name(nodeid))))
        refused_all += [(short, n, m) for n, m in c["refused"]]
        for nid in c["fail_trl"]:
            notes.append((short, nid, first_error(trl_res[nid])))
    head = (
        "| file | collected | run | pass on TRL | here: pass | refused | internals | failing | skip on TRL | "
        "no stand-in | fail on TRL | min TRL | min here |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        t = lambda s: "" if s is None else f"{s / 60:.1f}"
        lines.append("| " + " | ".join(map(str, r[:11])) + f" | {t(r[11])} | {t(r[12])} |")
    tot = [sum(r[i] for r in rows) for i in range(1, 11)]
    lines.append("| **all** | " + " | ".join(map(str, tot)) + " | | |")
    table = "\n".join(lines)
    print("\n" + table + "\n")

    md = [
        f"# TRL's trainer tests on instruct_goose\n",
        f"Written by `tests/trl/run.py` (`make test-trl`). TRL installed: {trl_version}; instruct_goose "
        f"{instruct_goose.__version__}. Tests: {source}.\n",
        "Each file ran twice with the same offline stand-ins (tests/trl/make_standins.py): on TRL, and on a copy "
        "whose only change is `from trl import XConfig, XTrainer` -> `from instruct_goose import ...`. "
        "The counts *here* cover the tests that pass on TRL: pass / refused on purpose (the error names the "
        "unsupported feature) / pokes TRL internals (run.py's INTERNALS) / failing. *no stand-in*: failed on TRL "
        "for a Hub repository with no offline stand-in here; *fail on TRL*: failed on TRL 1.16 for another reason "
        "(mostly: tests of another TRL revision). *min here* times only the tests that pass on TRL (the rest are not "
        "run here). Times are on 2 CPU cores shared with other work, so they vary.\n",
        table,
        "",
    ]
    subsets = [
        f"{s}: one test in {state[s]['every']}"
        + (f", first {state[s]['first']}" if state[s].get('first') else "")
        + f" ({state[s]['selected']} of {state[s]['collected']})"
        for s in files
        if s in state and state[s].get("selected") != state[s].get("collected")
    ]
    if subsets:
        md += ["**Subsets** (deterministic, by collection order): " + "; ".join(subsets) + ".\n"]
    if missing:
        md += [
            "Names the tests import from `trl` that TRL "
            + trl_version
            + " lacks (stubbed, on both sides): "
            + ", ".join(f"`{m}`" for m in sorted(missing))
            + ".\n"
        ]
    groups = defaultdict(list)
    for short, nodeid, msg, hints in failing_all:
        groups[group_key(msg)].append((short, nodeid, msg, hints))
    md += [f"## Failing here, grouped by first error ({len(failing_all)} tests)\n"]
    for i, (key, items) in enumerate(sorted(groups.items(), key=lambda kv: -len(kv[1])), 1):
        per_file = Counter(s for s, *_ in items)
        md += [
            f"### {i}. {len(items)} × `{items[0][2][:240].replace('`', chr(39))}`\n",
            "files: " + ", ".join(f"{f} {n}" for f, n in per_file.most_common()) + "\n",
        ]
        for short, nodeid, msg, hints in items[:40]:
            md.append(
                f"- `{nodeid.split('::', 1)[1]}`" + (f" (reaches into: {', '.join(hints)})" if hints else "")
            )
        if len(items) > 40:
            md.append(f"- … and {len(items) - 40} more")
        md.append("")
    if refused_all:
        md += [f"## Refused on purpose ({len(refused_all)} tests)\n"]
        rg = defaultdict(list)
        for short, n, m in refused_all:
            rg[group_key(m)].append((short, n, m))
        for key, items in sorted(rg.items(), key=lambda kv: -len(kv[1])):
            md.append(f"- {len(items)} × `{items[0][2][:200].replace('`', chr(39))}`")
        md.append("")
    if INTERNALS:
        md += (
            ["## Poking TRL internals (run.py's INTERNALS)\n"]
            + [f"- `{k}`: {v}" for k, v in INTERNALS.items()]
            + [""]
        )
    if notes:
        ng = Counter(group_key(m) for _, _, m in notes)
        md += [f"## Failing on TRL itself ({len(notes)} tests, left out of the measure), by first error\n"]
        ex = {}
        for _, _, m in notes:
            ex.setdefault(group_key(m), m)
        md += [f"- {n} × `{ex[k][:200].replace('`', chr(39))}`" for k, n in ng.most_common(15)] + [""]
    out.write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
