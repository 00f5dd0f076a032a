"""Every notebook run as `nbdev_test --n_workers 2` runs them, the slowest first.

    .venv/bin/python dev/test_notebooks.py [--n_workers 2] [--timing]

The same notebooks (nbdev's `nbglob`, `.notest` siblings skipped), the same runner (nbdev's `test_nb`: a fresh shell per
notebook, the `tst_flags` cells of settings.ini skipped, `IN_TEST` set) and the same parallel workers. Only the order
differs: `nbdev_test` takes the notebooks by name, so the longest tutorials (19, 20) start last and one core runs them
alone while the other waits. Longest first (`SECONDS`, measured on 2 cores) keeps both busy to the end.
"""
import argparse, sys, time

from fastcore.parallel import parallel
from fastcore.xtras import working_directory
from nbdev.config import get_config
from nbdev.doclinks import nbglob
from nbdev.test import _keep_file, test_nb

# seconds each notebook took under `make test` on 2 cores (2026-11-27); only their order matters, and a notebook not
# listed runs after these, in name order
SECONDS = {"17_tutorial_dpo": 94, "20_tutorial_tools": 89, "11_tutorial_pipeline": 88, "14_scaling": 80, "16_tutorial_grpo": 60,
           "19_tutorial_overoptimisation": 58, "09_rloo": 54, "09c_dpo": 49, "15_tutorial_rloo": 48, "12_tutorial_reward": 30,
           "10_cli": 28, "06_sft": 25, "08b_ppo": 25, "18_tutorial_from_trl": 25, "03a_decoding": 20, "05b_levers": 16}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n_workers", type=int, default=2, help="notebooks run at once, each in its own process")
    parser.add_argument("--timing", action="store_true", help="print each notebook's seconds, slowest first")
    args = parser.parse_args()
    config = get_config()
    files = [f.absolute() for f in sorted(nbglob(as_path=True)) if _keep_file(f, ".notest")]
    files.sort(key=lambda f: -SECONDS.get(f.stem, 0))                  # stable: unlisted ones keep their name order
    start = time.time()
    with working_directory(config.nbs_path):
        results = parallel(test_nb, files, skip_flags=config.tst_flags.split(), force_flags=[], n_workers=args.n_workers,
                           basepath=config.config_path, pause=0.01)
    passed, times = zip(*results)
    if args.timing:
        for f, t in sorted(zip(files, times), key=lambda ft: -ft[1]): print(f"{f.name}: {t:.0f} s")
    if not all(passed):
        failed = "\n\t".join(f.name for ok, f in zip(passed, files) if not ok)
        sys.exit(f"\nnbdev Tests Failed On The Following Notebooks:\n{'=' * 50}\n\t{failed}")
    print(f"Success: {len(files)} notebooks in {time.time() - start:.0f} s.")


if __name__ == "__main__":
    main()
