"""kiln's row schema, and rows read and written in it: what every trainer, reward and tool loads at run time.

A row:
    data_source : str                                  # picks the reward function
    prompt      : list[{"role": str, "content": str | list[part]}]
    images      : list[bytes | str | {"bytes", "path"}] (optional; one per {"type": "image"} part, in order)
    ability     : str                                  # "code", "swe", "vision"
    reward_model: {"style": "rule" | "judge", "ground_truth": str}   # JSON text for the code families
    extra_info  : {"index": int | str, "split": str, "difficulty": str (optional), ...}

ground_truth JSON per family (what rewards.py reads):
    apps, codecontests, taco, livecodebench: {"inputs": [...], "outputs": [...], "fn_name"?: str}
    humaneval: {"test": str, "entry_point": str, "prompt": str}
    mbpp, toy: {"test_list": ["assert ...", ...], "test_setup_code": str}
    swebench: SWE-bench 5.x instance fields {"instance_id", "repo", "version", "base_commit", "image", "eval_script",
               "log_parser", "eval_type", "FAIL_TO_PASS": [...], "PASS_TO_PASS": [...], "test_patch", "patch"}
               (the gold "patch" is for checks only; nothing of ground_truth is ever shown to the policy)
    task: a Harbor-style task directory (task_dirs.py): its task.toml settings (TaskSpec's fields), "image", and
               "environment", "tests", "solution" (optional) as base64 gzipped tars; shown to the policy: none of it
    calc: the exact answer as plain text (rewards.answer_reward)
    vl_agent family (vision_toy, vstar, chart, ...; rewards.py): the answer as plain text; vision_toy rows also have
               extra_info.target_box [x0, y0, x1, y1], the region of images[0] that holds the answer

`load_rows` reads .parquet, .jsonl or a Hugging Face dataset name (`org/name[@revision]`, downloaded once per
node: hub.fetch) and validates every row (a bad one raises
RowError naming file, row and field); a parquet file's rows stay on disk (`Rows`: a validated Arrow copy beside it,
memory-mapped and shared by the ranks, a row decoded when used); `write_rows` writes them back exactly;
`in_epoch_order` is the seeded order the trainers visit them in. data_prep.py converts public datasets into this
schema.
"""
from __future__ import annotations

import base64
import functools
import glob
import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import torch
from filelock import FileLock

import hub

IMAGE_MARKER = "<image>"  # CodeV's inline image placeholder, which kiln rows replace by image parts
IO_SOURCES = ("apps", "codecontests", "taco", "livecodebench")  # stdin/stdout or call-based tests, APPS format
# What rewards.py needs in ground_truth, per family.
GROUND_TRUTH_KEYS = {"io": {"inputs": list, "outputs": list}, "mbpp": {"test_list": list}, "toy": {"test_list": list},
                     "humaneval": {"test": str, "entry_point": str, "prompt": str},
                     "swebench": {"instance_id": str, "image": str, "eval_script": str, "log_parser": str,
                                  "eval_type": str, "base_commit": str, "FAIL_TO_PASS": list},
                     "task": {"name": str, "image": str, "environment": str, "tests": str}}
ROLES = ("system", "user", "assistant", "tool")
# Parquet has no "mixed type" column: columns arrow cannot hold exactly are stored as JSON text and listed here.
JSON_COLUMNS_KEY = b"kiln.json_columns"
# The Arrow copy of a parquet file's validated rows: beside it, stamped with the file's size and mtime it was made of.
ARROW_CACHE = ".{name}.kiln-rows-1.arrow"
SOURCE_STAMP_KEY = b"kiln.source_stamp"
# A value per row derived from the rows (a prompt's length under one tokenizer, ...), kept beside the Arrow copy and
# removed with it: named by what it is and a digest of what determines it (Rows.per_row).
PER_ROW_CACHE = "{arrow}.{name}-{digest}.npy"
BATCH_ROWS = 256  # rows of a column read at once
VALIDATE_ROWS = 32  # whole rows (tests, images) decoded at once while validating


class RowError(ValueError):
    """A row that does not fit the schema; the message names where (file, row) and the field."""


def validate_row(row: dict, where: str = "row") -> dict:
    """Check `row` against the schema; return a copy with null optional fields dropped.

    Parquet structs cannot tell a missing key from a null one, so null extra_info values count as absent.
    """
    def fail(field: str, problem: str):
        raise RowError(f"{where}: {field}: {problem}")

    def need(value, types, field: str):
        if not isinstance(value, types) or isinstance(value, bool):
            names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
            fail(field, f"expected {names}, got {type(value).__name__}")

    if not isinstance(row, dict):
        raise RowError(f"{where}: expected a dict, got {type(row).__name__}")
    row = {k: v for k, v in row.items() if v is not None}
    for field in ("data_source", "prompt", "ability", "reward_model", "extra_info"):
        if field not in row:
            fail(field, "missing")
    need(row["data_source"], str, "data_source")
    need(row["ability"], str, "ability")
    need(row["prompt"], list, "prompt")
    if not row["prompt"]:
        fail("prompt", "empty")
    for i, message in enumerate(row["prompt"]):
        need(message, dict, f"prompt[{i}]")
        if message.get("role") not in ROLES:
            fail(f"prompt[{i}].role", f"expected one of {ROLES}, got {message.get('role')!r}")
        need(message.get("content"), (str, list), f"prompt[{i}].content")
    if "images" in row:
        need(row["images"], list, "images")
        for i, image in enumerate(row["images"]):
            need(image, (bytes, str, dict), f"images[{i}]")
    parts, images = count_image_parts(row["prompt"]), len(row.get("images", []))
    if parts != images:  # the chat template renders one placeholder per part: each must get its image
        markers = any(IMAGE_MARKER in text for text in _prompt_texts(row["prompt"]))
        fail("images", f"{images} images but the prompt has {parts} image parts" + (
            f" (its text holds {IMAGE_MARKER} markers: convert the file with `python data_prep.py codev`)"
            if markers else ""))
    reward_model = row["reward_model"]
    need(reward_model, dict, "reward_model")
    if reward_model.get("style") not in ("rule", "judge"):
        fail("reward_model.style", f"expected 'rule' or 'judge', got {reward_model.get('style')!r}")
    need(reward_model.get("ground_truth"), str, "reward_model.ground_truth")
    _check_ground_truth(row["data_source"], reward_model["ground_truth"], fail)
    need(row["extra_info"], dict, "extra_info")
    extra_info = {k: v for k, v in row["extra_info"].items() if v is not None}
    need(extra_info.get("index"), (int, str), "extra_info.index")
    need(extra_info.get("split"), str, "extra_info.split")
    if "difficulty" in extra_info:
        need(extra_info["difficulty"], str, "extra_info.difficulty")
    if "harness" in extra_info:  # an external agent's harness for this row (--agent-cmd's {harness})
        need(extra_info["harness"], str, "extra_info.harness")
    return {**row, "extra_info": extra_info}


def _check_ground_truth(data_source: str, text: str, fail) -> None:
    family = "io" if data_source in IO_SOURCES else data_source
    if family not in GROUND_TRUTH_KEYS:
        return  # other families (judge, swe, ...) define their own ground truth
    field = "reward_model.ground_truth"
    try:
        truth = json_shape(text)
    except ValueError as e:
        fail(field, f"not valid JSON ({e})")
    if not isinstance(truth, dict):
        fail(field, f"expected a JSON object, got {type(truth).__name__}")
    for key, kind in GROUND_TRUTH_KEYS[family].items():
        if not isinstance(truth.get(key), kind) or not truth[key]:
            fail(f"{field}.{key}", f"expected a non-empty {kind.__name__} (a task without tests cannot be scored)")
    if family == "swebench" and not isinstance(truth.get("PASS_TO_PASS"), list):
        fail(f"{field}.PASS_TO_PASS", "expected a list")
    for key in ("fn_name", "test_setup_code"):
        if not isinstance(truth.get(key, ""), str):
            fail(f"{field}.{key}", "expected a string")
    if family == "io" and len(truth["inputs"]) != len(truth["outputs"]):
        fail(field, f"{len(truth['inputs'])} inputs but {len(truth['outputs'])} outputs")
    if not all(isinstance(test, str) for test in truth.get("test_list", [])):
        fail(f"{field}.test_list", "expected assert statements as strings")


def json_shape(text: str):
    """Parse JSON for its structure only: every integer reads as 0, since APPS has integers longer than
    int() accepts by default (sys.get_int_max_str_digits)."""
    return json.loads(text, parse_int=lambda _: 0)


def row_id(row: dict) -> str:
    """The task id samples refer to: "<data_source>/<extra_info.index>"."""
    return f"{row['data_source']}/{row['extra_info']['index']}"


def make_row(data_source: str, user_message: str, ground_truth: dict, extra_info: dict) -> dict:
    return {"data_source": data_source, "prompt": [{"role": "user", "content": user_message}], "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": json.dumps(ground_truth)}, "extra_info": extra_info}


def count_image_parts(prompt: list[dict]) -> int:
    """The {"type": "image"} parts of a prompt's messages: one image placeholder each in the rendered prompt."""
    return sum(isinstance(part, dict) and part.get("type") == "image"
               for message in prompt if isinstance(message, dict) and isinstance(message.get("content"), list)
               for part in message["content"])


def _prompt_texts(prompt: list[dict]) -> list[str]:
    return [part if isinstance(part, str) else str(part.get("text") or "")
            for message in prompt if isinstance(message, dict)
            for part in ([message.get("content")] if isinstance(message.get("content"), str)
                         else message.get("content") or []) if isinstance(part, (str, dict))]


def image_bytes(image, base: Path | None = None) -> bytes:
    """A row image as encoded bytes: bytes, a {"bytes", "path"} dict (Hugging Face's Image feature), a data URL, or
    a path (absolute, else relative to `base` when it exists there, else to the working dir)."""
    if isinstance(image, dict):
        return image["bytes"] if image.get("bytes") else image_bytes(image.get("path") or "", base)
    if isinstance(image, bytes):
        return image
    if image.startswith("data:image"):
        return base64.b64decode(image.partition(",")[2])
    path = Path(image)
    if base is not None and not path.is_absolute() and (base / path).is_file():
        path = base / path
    if not path.is_file():
        raise FileNotFoundError(f"image {image!r}: no such file")
    return path.read_bytes()


def row_images(row: dict) -> list[bytes]:
    """The row's images as encoded bytes, in the order of its image parts."""
    return [image_bytes(image) for image in row.get("images") or []]


def load_rows(source: str | os.PathLike, split: str = "train") -> Sequence[dict]:
    """Validated rows from a .parquet file (a lazy `Rows`), a .jsonl file (read whole) or a Hugging Face dataset name
    (`split` of it, read whole; collective under torchrun, see `hub_records`)."""
    path = Path(source)
    if path.suffix in (".parquet", ".jsonl") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"{source}: no such file" if not path.exists() else f"{source}: not a file")
        if path.suffix == ".parquet":
            return Rows.of_parquet(path, str(source))
        elif path.suffix == ".jsonl":
            rows = [validate_row(r, f"{source} line {n}") for n, r in read_jsonl(path)]
        else:
            raise ValueError(f"{source}: expected a .parquet or .jsonl file")
    elif dataset_name(str(source)) is not None:
        rows = [validate_row(r, f"{source}[{split}] row {i}") for i, r in enumerate(hub_records(str(source), split))]
    else:
        raise ValueError(f"{source}: not a .parquet/.jsonl file or a Hugging Face dataset name")
    if not rows:
        raise ValueError(f"{source}: no rows")
    _check_unique_ids(rows, source)
    return rows


class Rows(Sequence):
    """A parquet file's rows without holding them: an Arrow file of them, validated once and kept beside the parquet
    (ARROW_CACHE, made again when the parquet changes), memory-mapped, so the ranks of a node share its pages and none
    holds the rows in its heap. `rows[i]` decodes row i (validate_row's copy, as load_rows gave before); `values`
    reads one field of every row, a batch at a time; `per_row` a value derived from every row, computed once; a slice
    or `subset` is a view. Equal to a list of the same rows."""

    def __init__(self, table: pa.Table, json_columns: list[str], where: str, index: np.ndarray | None = None,
                 arrow: Path | None = None):
        self.table, self.json_columns, self.where, self.arrow = table, json_columns, where, arrow
        self.index = np.arange(table.num_rows) if index is None else index

    @classmethod
    def of_parquet(cls, path: Path, where: str) -> "Rows":
        cache = path.with_name(ARROW_CACHE.format(name=path.name))
        stamp = f"{path.stat().st_size}:{path.stat().st_mtime_ns}".encode()
        with FileLock(str(cache) + ".lock"):  # one rank of a node validates and writes it; the others wait, then read
            if not cache.is_file() or _arrow_metadata(cache).get(SOURCE_STAMP_KEY) != stamp:
                _write_arrow_cache(path, cache, stamp, where)
        table = ipc.open_file(pa.memory_map(str(cache))).read_all()  # zero-copy: the file's pages, not the heap
        return cls(table, json.loads((table.schema.metadata or {}).get(JSON_COLUMNS_KEY, b"[]")), where, arrow=cache)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.subset(self.index[i])
        j = int(self.index[i])
        return validate_row(_decoded(self.table.slice(j, 1).to_pylist(), self.json_columns)[0], f"{self.where} row {j}")

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, Rows)) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def subset(self, positions) -> "Rows":
        """The rows at `positions` (of this view), in that order."""
        return Rows(self.table, self.json_columns, self.where, self.index[np.asarray(positions, dtype=np.int64)],
                    self.arrow)

    def per_row(self, name: str, key: str, compute: Callable[[Sequence[dict]], Sequence[int]]) -> np.ndarray:
        """`compute(rows)`, one integer per row of the file, kept beside the Arrow copy (PER_ROW_CACHE) under `name` and
        a digest of `key` (everything `compute` depends on besides the rows) and the file's stamp: computed by the
        first caller of a node under the copy's lock, read by the other ranks and every later start, removed when the
        file changes. Returns this view's rows' values."""
        stamp = (self.table.schema.metadata or {}).get(SOURCE_STAMP_KEY, b"")
        digest = hashlib.sha256(key.encode() + b"\0" + stamp).hexdigest()[:16]
        path = self.arrow.with_name(PER_ROW_CACHE.format(arrow=self.arrow.name, name=name, digest=digest))
        with FileLock(str(self.arrow) + ".lock"):  # the copy's own lock: no rewrite of the copy while this is made
            values = np.load(path) if path.is_file() else None
            if values is None or len(values) != self.table.num_rows:
                values = np.asarray(compute(Rows(self.table, self.json_columns, self.where, arrow=self.arrow)),
                                    dtype=np.int64)
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                try:
                    with open(tmp, "wb") as f:
                        np.save(f, values)
                    os.replace(tmp, path)
                finally:
                    tmp.unlink(missing_ok=True)
        return values[self.index]

    def values(self, field: str) -> Iterator:
        """Each row's `field` ("data_source", "prompt", "reward_model.style", ...; None where absent), as the row holds
        it, without reading the other columns."""
        top, _, key = field.partition(".")
        if top not in self.table.column_names:
            yield from (None for _ in range(len(self)))
            return
        column = self.table.column(top)
        if key and top not in self.json_columns:
            column = pc.struct_field(column, key) if key in {f.name for f in column.type} else None
        if column is None:
            yield from (None for _ in range(len(self)))
            return
        for start in range(0, len(self), BATCH_ROWS):
            batch = column.take(pa.array(self.index[start:start + BATCH_ROWS])).to_pylist()
            for value in batch:
                if top in self.json_columns and value is not None:
                    value = json.loads(value)
                    value = value.get(key) if key and isinstance(value, dict) else value
                yield value


def values(rows: Sequence[dict], field: str) -> Iterator:
    """Each row's `field` ("a" or "a.b"; None where absent): from a `Rows` without decoding the rest of each row."""
    if isinstance(rows, Rows):
        return rows.values(field)
    top, _, key = field.partition(".")
    return ((row.get(top) or {}).get(key) if key else row.get(top) for row in rows)


def per_row(rows: Sequence[dict], name: str, key: str | None,
            compute: Callable[[Sequence[dict]], Sequence[int]]) -> np.ndarray:
    """`compute(rows)` as an array: for a parquet file's `Rows` computed once and kept (Rows.per_row); for other rows,
    or a `key` of None (what it depends on cannot be named), computed now."""
    if isinstance(rows, Rows) and rows.arrow is not None and key is not None:
        return rows.per_row(name, key, compute)
    return np.asarray(compute(rows), dtype=np.int64).reshape(len(rows))


def subset(rows: Sequence[dict], positions: list[int]) -> Sequence[dict]:
    """The rows at `positions`, in that order (a `Rows` stays a view)."""
    return rows.subset(positions) if isinstance(rows, Rows) else [rows[i] for i in positions]


def summaries(rows: Sequence[dict]) -> list[dict]:
    """What the checks before a run read of each row (data_source, ability, reward_model.style), without its prompt,
    tests or images."""
    return [{"data_source": source, "ability": ability, "reward_model": {"style": style}}
            for source, ability, style in zip(values(rows, "data_source"), values(rows, "ability"),
                                              values(rows, "reward_model.style"))]


def _arrow_metadata(path: Path) -> dict:
    return ipc.open_file(pa.memory_map(str(path))).schema.metadata or {}


def _write_arrow_cache(path: Path, cache: Path, stamp: bytes, where: str) -> None:
    """Validate `path`'s rows a batch at a time (a bad or repeated one raises RowError naming it) while writing them,
    as read, to an Arrow file renamed to `cache` once whole."""
    parquet = pq.ParquetFile(path)
    names = [n for n in parquet.schema_arrow.names if n != "__index_level_0__"]  # pandas' saved index, not data
    metadata = parquet.schema_arrow.metadata or {}
    json_columns = json.loads(metadata.get(JSON_COLUMNS_KEY, b"[]"))
    schema = pa.schema([parquet.schema_arrow.field(n) for n in names], metadata=metadata | {SOURCE_STAMP_KEY: stamp})
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    seen: dict[str, int] = {}
    count = 0
    try:
        with ipc.new_file(str(tmp), schema) as writer:
            for batch in parquet.iter_batches(batch_size=VALIDATE_ROWS, columns=names):
                for row in _decoded(batch.to_pylist(), json_columns):
                    task = row_id(validate_row(row, f"{where} row {count}"))
                    first = seen.setdefault(task, count)
                    if first != count:
                        raise RowError(f"{where} row {count}: extra_info.index: task id {task!r} repeats row {first}")
                    count += 1
                writer.write_batch(pa.RecordBatch.from_arrays(batch.columns, schema=schema))
        if not count:
            raise ValueError(f"{where}: no rows")
        for derived in glob.glob(glob.escape(str(cache)) + ".*.npy"):  # values of the rows this copy replaces
            os.unlink(derived)
        os.replace(tmp, cache)
    finally:
        tmp.unlink(missing_ok=True)


def in_epoch_order(items: list, start: int, count: int, seed: int) -> list:
    """Items `start` .. `start + count - 1` of an endless stream that visits `items` in a fresh seeded permutation every
    epoch (epoch e uses seed + e): a run that resumes at a position replays exactly the same order."""
    picked = []
    for position in range(start, start + count):
        epoch, offset = divmod(position, len(items))
        picked.append(items[_permutation(len(items), seed + epoch)[offset]])
    return picked


@functools.lru_cache(maxsize=2)
def _permutation(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def _check_unique_ids(rows: list[dict], where) -> None:
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        first = seen.setdefault(row_id(row), i)
        if first != i:
            raise RowError(f"{where} row {i}: extra_info.index: task id {row_id(row)!r} repeats row {first}")


def write_atomically(path, lines: Iterable[dict]) -> None:
    """JSONL written to a temp file beside `path`, then renamed over it: a crash never leaves a half-written file (the
    previous one, if any, stays whole) and the temp file is removed on any error."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_rows(rows: list[dict], path: str | os.PathLike) -> None:
    """Write validated rows to .parquet (verl layout) or .jsonl; `load_rows(path)` gives them back unchanged."""
    path = Path(path)
    rows = [validate_row(r, f"{path} row {i}") for i, r in enumerate(rows)]
    if not rows:
        raise ValueError(f"{path}: no rows to write")
    _check_unique_ids(rows, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        with open(path, "w") as f:
            for i, row in enumerate(rows):
                try:
                    f.write(json.dumps(row) + "\n")
                except TypeError as e:
                    raise ValueError(f"{path} row {i}: cannot be JSON ({e}); write .parquet instead") from e
        return
    if path.suffix != ".parquet":
        raise ValueError(f"{path}: expected a .parquet or .jsonl path")
    names = list(dict.fromkeys(k for row in rows for k in row))
    json_columns: list[str] = []
    arrays = []
    for name in names:
        values = [row.get(name) for row in rows]
        if name == "extra_info":  # by key, so one odd key does not turn the whole struct into text
            keys = list(dict.fromkeys(k for v in values for k in v))
            children = [_column([v.get(k) for v in values], f"extra_info.{k}", json_columns, path) for k in keys]
            arrays.append(pa.StructArray.from_arrays(children, names=keys))
        else:
            arrays.append(_column(values, name, json_columns, path))
    table = pa.Table.from_arrays(arrays, names=names)
    table = table.replace_schema_metadata({JSON_COLUMNS_KEY: json.dumps(json_columns).encode()})
    pq.write_table(table, path)


def _column(values: list, name: str, json_columns: list[str], path: Path) -> pa.Array:
    """An arrow array holding `values` exactly, or their JSON text where arrow would change them.

    pyarrow infers one type per column: it unions struct keys (filling nulls), fails on int-vs-str, and so on.
    """
    try:
        array = pa.array(values)
        if _same(array.to_pylist(), values):
            return array
    except (pa.ArrowException, OverflowError):
        pass
    json_columns.append(name)
    try:
        return pa.array([None if v is None else json.dumps(v) for v in values], pa.string())
    except TypeError as e:
        raise ValueError(f"{path}: column {name} mixes types parquet cannot hold and is not JSON ({e})") from e


def _same(a, b) -> bool:
    """Equality that also requires equal types (1 != 1.0 != True here), so a round trip is exact."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _decoded(rows: list[dict], json_columns: list[str]) -> list[dict]:
    """Rows as pyarrow read them with their JSON-text columns (JSON_COLUMNS_KEY) parsed back, in place."""
    for name in json_columns:
        top, _, key = name.partition(".")
        for row in rows:
            holder, field = (row.get(top), key) if key else (row, top)
            if holder is not None and holder.get(field) is not None:
                holder[field] = json.loads(holder[field])
    return rows


def read_jsonl(path: Path):
    """(line number, record) for each non-blank line of a JSON Lines file; a bad line raises RowError naming it."""
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield n, json.loads(line)
                except ValueError as e:
                    raise RowError(f"{path} line {n}: not valid JSON ({e})") from e


def hub_error(name: str, e: Exception) -> RuntimeError:
    return RuntimeError(
        f"could not get {name!r} from the Hugging Face hub ({type(e).__name__}: {e}). If the hub is unreachable "
        "(offline machine, HF_HUB_OFFLINE=1), fetch the data elsewhere and pass a local path instead.")


def dataset_name(source: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when `source` names a Hugging Face dataset (`org/name[@revision]`), None for a file."""
    return None if Path(source).suffix in (".parquet", ".jsonl") else hub.hub_name(source)


def check_source(source: str, flag: str) -> None:
    """Refuse, before anything loads, a dataset named by hub name that HF_HUB_OFFLINE=1 keeps from downloading and
    the local cache does not hold (hub.check_cached); a file is load_rows' to check."""
    if dataset_name(source) is not None:
        hub.check_cached(source, f"{flag} {source}", "dataset")


def hub_records(name: str, split: str | None) -> list[dict]:
    """Records of a Hugging Face dataset `org/name[@revision]` (all splits when `split` is None): its snapshot,
    downloaded into the hub cache by local rank 0 of each node while the other ranks wait (hub.fetch), then read
    from those files by every rank (`datasets`, which knows the hub's layouts of configs and splits)."""
    local = hub.fetch(name, kind="dataset")
    try:
        import datasets  # only here: a second of import for every script that never reads the hub
    except ImportError as e:
        raise RuntimeError(f"loading the Hugging Face dataset {name!r} needs `pip install datasets`") from e
    try:
        loaded = datasets.load_dataset(local, split=split)
    except Exception as e:  # a split or config it lacks, files it cannot parse: the library's first line says which
        part, why = f"split {split!r} of its files" if split else "its files", str(e).strip().partition("\n")[0]
        raise ValueError(f"{name}: cannot read {part} in {local} ({type(e).__name__}: {why})") from e
    parts = loaded.values() if split is None else [loaded]
    return [dict(record) for part in parts for record in part]
