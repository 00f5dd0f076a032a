"""Where the bench scripts keep what they measure: `bench/results/<date>_<what>/`, one folder a measurement run.

Standard library only, so a script's parent process can import it without torch."""
import datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def results_dir(what, date=None):
    "`bench/results/<date>_<what>/` (today's date unless given), made if missing."
    d = RESULTS / f"{date or datetime.date.today().isoformat()}_{what}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def latest(what, name):
    "The newest `bench/results/<date>_<what>/<name>` (the folders' names sort by their dates)."
    found = sorted(RESULTS.glob(f"????-??-??_{what}/{name}"))
    if not found: raise FileNotFoundError(f"no bench/results/<date>_{what}/{name}")
    return found[-1]
