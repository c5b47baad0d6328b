"""Training rows at real size: each rank's private memory and its time to the first batch, loading a parquet file of
APPS-like rows the way the trainers do (task_rows.load_rows, then rollout.load_rows_within's prompt-length filter,
then the first batch of the seeded epoch order), today's whole-file load against the memory-mapped Arrow rows.

Synthetic rows: `--rows` (20,000) rows with `--test-kb` (128 KB) of test cases each, and with `--image-mb` > 0 one
image of that size per row (the image variant: `--image-mb 1`). `--ranks` processes load at once, as the ranks of a
node do. Memory is the rise of each rank's anonymous resident pages (RssAnon, sampled every 20 ms) above what its
imports took: the shared file pages of a memory map do not count, a heap copy does. Three runs:
- today: every rank reads the whole file into Python objects (the load_rows before the Arrow rows); at most
  `--today-rows` rows (a rank holds them all: 20,000 x 128 KB would take ~8 GB per rank on this 23 GB machine);
- after, cold: the first load, which validates the rows once and writes the Arrow copy beside the parquet, and
  measures every prompt once;
- after, warm: every later start (the copy and the prompt lengths beside it are there).
The data goes to a temporary folder, removed at the end (about 2 x rows x (test + image) bytes on disk).

    .venv/bin/python bench/data_scale.py [--rows 20000 --test-kb 128 --image-mb 0 --ranks 2]

Ends with `RESULT {json}`: rows, private_mb_per_rank and first_batch_s of the warm start (the most over the ranks),
and the same for the cold start and today's load.
"""
from __future__ import annotations

import io
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa
import pyarrow.parquet as pq
import tyro
from PIL import Image

import policy
import rollout
import task_rows
import tiny

BATCH = 8  # prompts of the first batch


@dataclass
class Args:
    rows: int = 20000
    """rows of the synthetic set"""
    test_kb: int = 128
    """test cases per row, in KB"""
    image_mb: float = 0.0
    """one image of this size per row (0: none)"""
    ranks: int = 2
    """processes loading at once"""
    today_rows: int = 2000
    """rows for today's whole-file load (0: skip it)"""
    worker: str | None = None
    """(internal) run one rank: "MODE PARQUET TOKENIZER_DIR" """


def anon_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status")


def load_rows_today(source, split="train") -> list[dict]:
    """load_rows as it was: the whole parquet file as Python objects, every row validated."""
    table = pq.read_table(source)
    json_columns = json.loads((table.schema.metadata or {}).get(task_rows.JSON_COLUMNS_KEY, b"[]"))
    rows = [task_rows.validate_row(r, f"{source} row {i}")
            for i, r in enumerate(task_rows._decoded(table.to_pylist(), json_columns))]
    task_rows._check_unique_ids(rows, source)
    return rows


def rank(mode: str, parquet: str, tokenizer_dir: str) -> dict:
    tokenizer = policy.load_tokenizer(tokenizer_dir)
    if mode == "today":
        rollout.task_rows.load_rows = load_rows_today
    base, peak, done = anon_kb(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon_kb())
            time.sleep(0.02)
    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    rows = rollout.load_rows_within(parquet, tokenizer, max_prompt_tokens=512, verbose=False)
    batch = task_rows.in_epoch_order(rows, 0, BATCH, seed=0)
    seconds = time.perf_counter() - start
    assert len(batch) == BATCH and all(len(r["reward_model"]["ground_truth"]) > 1000 for r in batch)
    time.sleep(0.1)
    peak[0] = max(peak[0], anon_kb())
    done.set()
    return {"private_mb": (peak[0] - base) / 1024, "first_batch_s": seconds, "rows": len(rows)}


def write_rows(path: Path, n: int, test_kb: int, image_mb: float) -> None:
    """n APPS-shaped rows, written a few hundred at a time (the writer never holds the set)."""
    rng = random.Random(0)
    chunks = ["\n".join(str(rng.randrange(10**9)) for _ in range(800))[:8192] for _ in range(64)]
    per_side = max(1, test_kb // 16)
    images = []
    if image_mb:
        side = int((image_mb * 2**20 / 3) ** 0.5)
        for i in range(8):
            buffer = io.BytesIO()
            Image.frombytes("RGB", (side, side), random.Random(i).randbytes(side * side * 3)).save(buffer, "PNG")
            images.append(buffer.getvalue())
    writer, schema = None, None
    for start in range(0, n, 250):
        batch = []
        for i in range(start, min(n, start + 250)):
            truth = {"inputs": [chunks[(i + k) % 64] for k in range(per_side)],
                     "outputs": [chunks[(i * 7 + k) % 64] for k in range(per_side)]}
            text = f"Problem {i}: read numbers from stdin and print their sum modulo {i + 7}."
            content = [{"type": "image"}, {"type": "text", "text": text}] if images else text
            row = {"data_source": "apps", "prompt": [{"role": "user", "content": content}], "ability": "code",
                   "reward_model": {"style": "rule", "ground_truth": json.dumps(truth)},
                   "extra_info": {"index": i, "split": "train"}}
            if images:
                row["images"] = [images[i % len(images)]]
            batch.append(row)
        table = pa.Table.from_pylist(batch, schema=schema)
        if writer is None:
            schema = table.schema
            writer = pq.ParquetWriter(path, schema)
        writer.write_table(table)
    writer.close()


def run_ranks(args: Args, mode: str, parquet: Path, tokenizer_dir: Path) -> dict:
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", f"{mode} {parquet} {tokenizer_dir}"],
                              stdout=subprocess.PIPE, text=True) for _ in range(args.ranks)]
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"{mode} rank exited with {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    summary = {"private_mb_per_rank": round(max(r["private_mb"] for r in results), 1),
               "first_batch_s": round(max(r["first_batch_s"] for r in results), 2)}
    print(f"{mode}: {summary} ({args.ranks} ranks, {results[0]['rows']} rows)", flush=True)
    return summary


def main(args: Args) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="kiln-data-scale-"))
    try:
        tokenizer_dir = tiny.make_tiny_model(folder / "model", ["Problem 1: read numbers and print the sum."] * 50)
        result = {"rows": args.rows, "test_kb": args.test_kb, "image_mb": args.image_mb, "ranks": args.ranks}
        if args.today_rows:
            small = folder / "today.parquet"
            write_rows(small, min(args.rows, args.today_rows), args.test_kb, args.image_mb)
            today = run_ranks(args, "today", small, tokenizer_dir)
            result |= {"today_rows": min(args.rows, args.today_rows), **{f"today_{k}": v for k, v in today.items()}}
            small.unlink()
        parquet = folder / "train.parquet"
        start = time.perf_counter()
        write_rows(parquet, args.rows, args.test_kb, args.image_mb)
        print(f"wrote {args.rows} rows, {parquet.stat().st_size / 2**20:.0f} MB, in {time.perf_counter() - start:.0f} s",
              flush=True)
        cold = run_ranks(args, "after-cold", parquet, tokenizer_dir)
        warm = run_ranks(args, "after-warm", parquet, tokenizer_dir)
        cache = parquet.with_name(task_rows.ARROW_CACHE.format(name=parquet.name))
        result |= {f"cold_{k}": v for k, v in cold.items()} | warm | {"arrow_mb": round(cache.stat().st_size / 2**20)}
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.worker:
        print(json.dumps(rank(*args.worker.split(" "))))
    else:
        print("RESULT " + json.dumps(main(args)))
