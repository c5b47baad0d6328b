"""The run board: `python board.py RUN_DIR [OTHER_RUN ...]` serves one page on http://127.0.0.1:8008 that shows a
training run (or `rollout.py generate` output) as its files grow: curves from metrics.jsonl (two runs on one chart),
per-dataset and per-difficulty evaluation snapshots, and a trajectory browser over samples.jsonl (the rich records of
--rich-samples: turns, tool calls and their images, tokens coloured by loss mask, advantage or |trainer - engine|
logprob, the group side by side, a SWE sample's diff and its FAIL_TO_PASS / PASS_TO_PASS tests).

One process on Python's standard HTTP server; the page is plain HTML with its script inline (no build step, nothing
fetched from elsewhere: it works offline). Samples are never all loaded: an index keeps each line's byte offset and
step (read from the line's head), a step's records are parsed when that step is looked at, one record when it is
opened. A live run is followed by polling the files' sizes.
"""
from __future__ import annotations

import errno
import json
import math
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Annotated
from urllib.parse import parse_qs, urlparse

import tyro

from sample_files import IMAGE_PATH, SAMPLE_FILES

# Matched at each line's start (re.match): a trainer's record begins with its step; generate.py's have none.
STEP_HEAD = re.compile(rb'\{"step": (\d+)')
MIME = {"png": "image/png", "jpeg": "image/jpeg", "gif": "image/gif", "webp": "image/webp", "bmp": "image/bmp"}


@dataclass
class Args:
    runs: Annotated[list[str], tyro.conf.Positional]
    """run directories (a trainer's --output-dir, or a folder with generate.py's samples.jsonl); the first is browsed,
    all are drawn on the charts"""
    host: str = "127.0.0.1"
    """address to listen on (the board has no authentication: keep it local)"""
    port: int = 8008
    """port to listen on (0 = any free port, printed)"""


@dataclass
class SampleIndex:
    """Byte offsets and steps of a run's sample lines, extended as the files grow and rebuilt when they rotate; the
    summaries of the lines parsed so far."""

    run: Path
    lines: list[tuple[int, int, int]] = field(default_factory=list)  # (file number in SAMPLE_FILES, offset, step)
    scanned: dict = field(default_factory=dict)  # file number -> (inode, bytes indexed)
    summaries: dict = field(default_factory=dict)  # line number -> summary()

    def refresh(self) -> None:
        """Index the lines written since the last call; start over when a file was rotated (runlog's rotation renames
        samples.jsonl to samples.old.jsonl) or cut back (a resumed run)."""
        stats = {k: (self.run / name).stat() for k, name in enumerate(SAMPLE_FILES) if (self.run / name).exists()}
        for k, (inode, done) in self.scanned.items():
            if k not in stats or stats[k].st_ino != inode or stats[k].st_size < done:
                self.lines, self.scanned, self.summaries = [], {}, {}
                break
        for k in sorted(stats):
            done = self.scanned.get(k, (0, 0))[1]
            with open(self.run / SAMPLE_FILES[k], "rb") as f:
                f.seek(done)
                data = f.read(stats[k].st_size - done)
            start = 0
            while (end := data.find(b"\n", start)) != -1:
                if end > start:
                    head = STEP_HEAD.match(data, start, min(end, start + 32))
                    self.lines.append((k, done + start, int(head.group(1)) if head else 0))
                start = end + 1
            self.scanned[k] = (stats[k].st_ino, done + start)  # a partly written last line waits for its end

    def record(self, n: int) -> dict:
        k, offset, _ = self.lines[n]
        with open(self.run / SAMPLE_FILES[k], "rb") as f:
            f.seek(offset)
            return json.loads(f.readline())

    def summary(self, n: int) -> dict:
        if n not in self.summaries:
            self.summaries[n] = summarize(n, self.record(n))
        return self.summaries[n]

    def steps(self) -> list[list[int]]:
        counts: dict[int, int] = {}
        for _, _, step in self.lines:
            counts[step] = counts.get(step, 0) + 1
        return [[step, count] for step, count in counts.items()]


def summarize(n: int, record: dict) -> dict:
    """What the sample list shows and filters on."""
    calls = record["tool_calls"] if isinstance(record.get("tool_calls"), list) else []  # generate.py: a count
    count = len(calls) if calls else record.get("tool_calls") or (record.get("info") or {}).get("tool_calls", 0)
    return {"id": n, "step": record.get("step", 0), "task_id": record.get("task_id"),
            "data_source": record.get("data_source") or str(record.get("task_id", "")).split("/")[0],
            "group": record.get("group"), "reward": record.get("reward"), "advantage": record.get("advantage"),
            "finish_reason": record.get("finish_reason"), "error": record.get("error"),
            "tool_calls": count, "tool_errors": sum(bool(c.get("error")) for c in calls),
            "tool_images": sum(len(c.get("images") or []) for c in calls), "images": len(record.get("images") or []),
            "tokens": len(record.get("token_ids") or []), "preview": (record.get("completion") or "")[:120]}


def matches(s: dict, query: dict) -> bool:
    """A summary against the browser's filters (absent = any)."""
    if "source" in query and s["data_source"] != query["source"]:
        return False
    if "finish" in query and s["finish_reason"] != query["finish"]:
        return False
    if "group" in query and str(s["group"]) != query["group"]:
        return False
    reward = s["reward"] if isinstance(s["reward"], (int, float)) else math.nan
    if "reward_min" in query and not reward >= float(query["reward_min"]):
        return False
    if "reward_max" in query and not reward <= float(query["reward_max"]):
        return False
    if query.get("tool_errors") == "1" and not s["tool_errors"]:
        return False
    if query.get("tool_images") == "1" and not s["tool_images"]:
        return False
    return True


@dataclass
class Metrics:
    """metrics.jsonl read incrementally: the numeric columns as {key: [[step, value], ...]}."""

    path: Path
    done: int = 0
    series: dict = field(default_factory=dict)

    def refresh(self) -> None:
        if not self.path.exists():
            return
        size = self.path.stat().st_size
        if size < self.done:  # rewritten (a resumed run cut it back)
            self.done, self.series = 0, {}
        with open(self.path, "rb") as f:
            f.seek(self.done)
            data = f.read(size - self.done)
        complete = data[: data.rfind(b"\n") + 1]
        self.done += len(complete)
        for line in complete.splitlines():
            if not line.strip():
                continue
            m = json.loads(line)
            step = m.get("step", 0)
            for key, value in m.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self.series.setdefault(key, []).append([step, value])

    def evals(self) -> dict:
        """Evaluation snapshots: {step: {group: {metric: value}}} from the val-core/val-aux keys (group: all, a data
        source, or source/difficulty)."""
        out: dict = {}
        for key, points in self.series.items():
            parts = key.split("/")
            if parts[0] not in ("val-core", "val-aux") or len(parts) < 3 or parts[1] == "error":
                continue
            band = "band" in parts[2:-1]
            group = "/".join(parts[1: parts.index("band")] if band else parts[1:-1])
            if group == "all/reward":
                group, name = "all", "reward/mean"
            else:
                name = ("band/" if band else "") + parts[-1]
            for step, value in points:
                out.setdefault(step, {}).setdefault(group, {})[name] = value
        return out


def finite(value):
    """JSON-safe copy: NaN and infinities become null (a judge failure's reward is NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


@dataclass
class Board:
    runs: list[Path]
    indexes: list[SampleIndex]
    metrics: list[Metrics]
    lock: threading.Lock = field(default_factory=threading.Lock)  # one request reads or extends the indexes at a time

    @classmethod
    def open(cls, dirs: list[str]) -> "Board":
        runs = [Path(d) for d in dirs]
        for run in runs:
            if not run.is_dir():
                raise FileNotFoundError(f"{run}: no such run directory")
            if not any((run / name).exists() for name in (*SAMPLE_FILES, "metrics.jsonl")):
                raise FileNotFoundError(f"{run}: neither metrics.jsonl nor samples.jsonl (is it a run's --output-dir?)")
        return cls(runs, [SampleIndex(r) for r in runs], [Metrics(r / "metrics.jsonl") for r in runs])

    def answer(self, path: str, query: dict) -> tuple[int, str, bytes]:
        """(status, content type, body) of one request."""
        if path == "/":
            return 200, "text/html; charset=utf-8", PAGE.encode()
        if path == "/favicon.ico":
            return 204, "text/plain", b""
        run = int(query.get("run", "0"))
        if not 0 <= run < len(self.runs):
            return 404, "text/plain", b"no such run"
        if path == "/file":
            name = query.get("path", "")
            if not IMAGE_PATH.fullmatch(name) or not (self.runs[run] / name).is_file():
                return 404, "text/plain", b"no such image"
            kind = MIME.get(name.rsplit(".", 1)[1], "application/octet-stream")
            return 200, kind, (self.runs[run] / name).read_bytes()
        with self.lock:
            body = self.api(path, run, query)
        if body is None:
            return 404, "text/plain", b"no such endpoint"
        return 200, "application/json", json.dumps(finite(body)).encode()

    def api(self, path: str, run: int, query: dict):
        index, metrics = self.indexes[run], self.metrics[run]
        if path == "/api/runs":
            return [{"name": r.name, "path": str(r)} for r in self.runs]
        if path == "/api/status":  # what the page polls to follow a live run
            files = [r / name for r in self.runs for name in (*SAMPLE_FILES, "metrics.jsonl")]
            return [f.stat().st_size if f.exists() else 0 for f in files]
        if path == "/api/keys":
            metrics.refresh()
            return sorted(metrics.series)
        if path == "/api/series":
            metrics.refresh()
            return {k: metrics.series.get(k, []) for k in query.get("keys", "").split(",") if k}
        if path == "/api/evals":
            metrics.refresh()
            return metrics.evals()
        if path == "/api/steps":
            index.refresh()
            return index.steps()
        if path == "/api/samples":
            index.refresh()
            return self.samples(index, query)
        if path == "/api/sample":
            index.refresh()
            n = int(query["id"])
            if not 0 <= n < len(index.lines):
                raise KeyError(f"no sample {n} (the run has {len(index.lines)})")
            return index.record(n) | {"id": n}
        return None

    @staticmethod
    def samples(index: SampleIndex, query: dict) -> dict:
        """A page of summaries (`offset`, `limit`) of the samples of `step` (all steps without one) that pass the
        filters, with the step's data sources and finish reasons for the filter menus. Only that step's lines are
        parsed (and kept as summaries)."""
        step = int(query["step"]) if "step" in query else None
        chosen = [n for n, (_, _, s) in enumerate(index.lines) if step is None or s == step]
        offset, limit = int(query.get("offset", "0")), min(int(query.get("limit", "50")), 500)
        items, total, sources, finishes = [], 0, set(), set()
        for n in chosen:
            s = index.summary(n)
            sources.add(s["data_source"])
            finishes.add(s["finish_reason"])
            if matches(s, query):
                if offset <= total < offset + limit:
                    items.append(s)
                total += 1
        return {"total": total, "items": items, "sources": sorted(map(str, sources)),
                "finish_reasons": sorted(map(str, finishes))}


def serve(board: Board, host: str, port: int) -> ThreadingHTTPServer:
    """The board's HTTP server, bound (port 0: a free one); call serve_forever on it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                status, kind, body = board.answer(url.path, query)
            except (ValueError, KeyError, OSError) as e:  # a bad query or a file caught mid-rotation
                status, kind, body = 400, "text/plain", f"{type(e).__name__}: {e}".encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_request(self, code="-", size="-"):  # quiet: only failed requests are printed
            if isinstance(code, int) and code >= 400:
                super().log_request(code, size)

    return ThreadingHTTPServer((host, port), Handler)


PAGE = (Path(__file__).resolve().parent / "board.html").read_text()


def main(args: Args) -> None:
    """Serve the board until interrupted; a busy port is one error line, not a traceback."""
    board = Board.open(args.runs)
    try:
        server = serve(board, args.host, args.port)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        raise SystemExit(f"error: port {args.port} of {args.host} is in use (another board?): pick another with "
                         f"--port N, or --port 0 for any free one") from None
    print(f"board of {', '.join(args.runs)} on http://{args.host}:{server.server_address[1]}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except FileNotFoundError as e:  # a wrong run directory: one line (cli.one_line_errors' imports take seconds)
        raise SystemExit(f"error: {e}") from None
