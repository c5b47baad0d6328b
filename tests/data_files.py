"""Where the tests' public data lies: inside the checkout, under tests/data (its README names each file's source,
commit, licence and checksum). Nothing the tests read lies outside the repository."""
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
APPS_DIR = DATA / "apps"  # 5 real problems: 2 introductory (call-based), 2 interview, 1 competition
MBPP_FILE = DATA / "mbpp" / "mbpp.jsonl"  # all 974 problems
SWE_LITE_DEV = DATA / "swebench" / "swe-bench-lite-dev.json"  # SWE-bench Lite's 23 dev instances
