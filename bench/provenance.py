"""The commit a benchmark result records, and writing the result (shared by the benchmarks that write results)."""
import json
import os
import pathlib
import subprocess


def commit_of(explicit=None):
    """The commit to record: explicit, else $POISE_COMMIT (device runs carry it in; their checkout's git
    may be stale), else git's HEAD, else "unknown"."""
    if explicit:
        return explicit
    if os.environ.get("POISE_COMMIT"):
        return os.environ["POISE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=pathlib.Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def write_result(out, result: dict) -> None:
    """Writes a benchmark's result as JSON to ``out`` (its folder created) and prints it."""
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
