"""The agent's tools: a toolbox per trajectory (`python` in the sandbox's PythonSession, called through <tool_call> or,
`codev`, through CodeV's <code> tags; `bash`, `str_replace_editor` and `submit` in the trajectory's own SWE-bench
container, or a task directory's: `--tools swe` runs both kinds of rows), their JSON signatures for the prompt, the
limits on images shown to the model, and the checks on swebench and task rows before anything loads."""
from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import re
import shlex
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

from PIL import Image, UnidentifiedImageError

import containers
import sandbox
import swe_grading
import task_dirs
import task_rows
import vision

SWE_CONTAINER = containers.ContainerLimits(timeout=60.0, output_cap=10_000)  # an agent's container; see docs/swebench.md
SWE_MAX_COMMAND_SECONDS = 600  # the most a `bash` call may ask for (docs/swebench.md's budget table)


@dataclass
class ToolResult:
    text: str
    images: list[bytes] = field(default_factory=list)  # PNG bytes, shown to the model as image parts
    error: bool = False  # the call failed (bad arguments, exception, timeout): counted in the metrics
    stop: bool = False  # the trajectory ends after this call (swe's `submit`), on the policy's own turn
    infra_failure: str = ""  # why the infrastructure failed under the call (containers.InfraFailure): the trajectory is
    # dropped and counted, never scored


@dataclass
class ToolBox:
    """One trajectory's tools: name -> function(arguments) -> ToolResult, their JSON signatures for the prompt,
    and what releases their state when the trajectory ends. `info` goes into the sample's info once `close` has run;
    a "completion" there is what the reward grades instead of the assistant's text (swe: the container's diff)."""

    tools: dict[str, Callable[[dict], ToolResult]]
    schemas: list[dict]
    close: Callable[[], None] = lambda: None
    info: dict = field(default_factory=dict)
    protocol: Literal["tool_call", "codev"] = "tool_call"  # how the policy calls them (chat.py's docstring)


def tool_message(result: ToolResult) -> dict:
    if not result.images:
        return {"role": "tool", "content": result.text}
    parts = [{"type": "text", "text": result.text}] + [{"type": "image"}] * len(result.images)
    return {"role": "tool", "content": parts}


def call_tool(box: ToolBox, call: dict | str) -> tuple[ToolResult, float]:
    """One call (or a parse error) -> its result and wall seconds; a tool's exception becomes an error result."""
    if isinstance(call, str):
        return ToolResult(call, error=True), 0.0
    start = time.perf_counter()
    try:
        result = box.tools[call["name"]](call["arguments"])
    except containers.InfraFailure as e:  # not the policy's doing: the rollout drops the trajectory
        result = ToolResult(f"Error: the container failed: {e}", error=True, infra_failure=str(e))
    except Exception as e:  # a tool bug must not kill the rollout: the model sees it, the metrics count it
        result = ToolResult(f"Error: {call['name']} raised {type(e).__name__}: {e}", error=True)
    return result, time.perf_counter() - start


PYTHON_TOOL = {"type": "function", "function": {
    "name": "python",
    "description": "Run Python code in a persistent session (variables, imports and files are kept). The task's image "
    "is `image` (PIL) and input_image.png; images you show or save and matplotlib figures are returned.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
# Models trained on ChatGPT's code interpreter write files to /mnt/data; here that is the session's working dir.
HALLUCINATED_DIR = re.compile(r"""(?<=['"])/mnt/data(/+|(?=['"]))""")


def rewrite_paths(code: str) -> str:
    """Quoted paths under /mnt/data made relative to the working dir ("/mnt/data/x.png" -> "x.png", and "." for the
    dir itself)."""
    return HALLUCINATED_DIR.sub(lambda m: "" if m.group(1) else ".", code)


@dataclass(frozen=True)
class ImageLimits:
    """What of the images a call returns reaches the model (CodeV's tool and Qwen2.5-VL's preprocessing): too
    elongated ones are dropped (the image processor refuses aspect ratios over 200), tiny ones upscaled to one merged
    patch, huge ones downscaled, and only the first few kept."""

    max_images: int = 5  # per call
    max_aspect: float = vision.MAX_ASPECT_RATIO
    min_side: int = vision.MIN_SIDE  # pixels: one 2x2 merge of 14-pixel patches
    max_pixels: int = 12_845_056  # Qwen2.5-VL's preprocessor_config max_pixels


def fit_images(images: list[bytes], limits: ImageLimits = ImageLimits()) -> tuple[list[bytes], list[str]]:
    """`images` (PNG bytes from the sandbox, untrusted) within `limits`: (the PNGs to show, notes for the model on
    what was dropped or resized). Sizes are read from the header before anything is decoded."""
    kept, notes = [], []
    for k, data in enumerate(images):
        try:
            picture = Image.open(io.BytesIO(data))
            width, height = picture.size
            if max(width, height) > limits.max_aspect * min(width, height):
                notes.append(f"image {k + 1} dropped: its aspect ratio {width}x{height} is over {limits.max_aspect:g}")
                continue
            if width * height > 4 * limits.max_pixels:  # decoding it to scale it down would cost too much
                notes.append(f"image {k + 1} dropped: {width}x{height} is too large")
                continue
            scale = max(limits.min_side / min(width, height), 1.0)
            scale = min(scale, math.sqrt(limits.max_pixels / (width * height)))
            if scale != 1.0:
                size = (max(1, round(width * scale)), max(1, round(height * scale)))
                buf = io.BytesIO()
                picture.convert("RGB").resize(size, Image.Resampling.BICUBIC).save(buf, format="PNG")
                data = buf.getvalue()
            kept.append(data)
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            notes.append(f"image {k + 1} dropped: not a readable image ({type(e).__name__})")
    if len(kept) > limits.max_images:
        notes.append(f"only the first {limits.max_images} of {len(kept)} images are kept")
        kept = kept[: limits.max_images]
    return kept, notes


def python_toolbox(row: dict, protocol: Literal["tool_call", "codev"] = "tool_call",
                   limits: ImageLimits = ImageLimits()) -> ToolBox:
    """The `python` tool: one sandbox.PythonSession per trajectory, given all the row's images; the images a call
    returns pass `limits`, and quoted paths under /mnt/data are read as the working dir's."""
    session = sandbox.PythonSession(input_images=task_rows.row_images(row), max_images=4 * limits.max_images)

    def python(arguments: dict) -> ToolResult:
        if not isinstance(arguments.get("code"), str):
            return ToolResult('Error: python needs {"code": <string>}', error=True)
        out = session.run(rewrite_paths(arguments["code"]))
        images, notes = fit_images(out.images, limits)
        text = out.stdout + out.stderr + (out.error or "") + "".join(f"\n[{note}]" for note in notes)
        return ToolResult(text or "(no output)", images=images, error=out.error is not None)

    return ToolBox({"python": python}, [PYTHON_TOOL] if protocol == "tool_call" else [], close=session.close,
                   protocol=protocol)


def codev_toolbox(row: dict) -> ToolBox:
    """The python tool called through CodeV's tags (<code>```python ...```</code>): no signatures in the prompt, the
    row's own prompt says how (data_prep.CODEV_SYSTEM)."""
    return python_toolbox(row, protocol="codev")


SWE_TOOLS = [
    {"type": "function", "function": {
        "name": "bash",
        "description": "Run one bash command in /testbed, without network. It is killed after `timeout` seconds; "
        "only files persist between calls (no cd, no variables, no background jobs); long output keeps its head and "
        "tail.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "the command, e.g. grep -rn 'def foo' src"},
            "timeout": {"type": "integer", "description": f"seconds before it is killed (default 60, at most "
                        f"{SWE_MAX_COMMAND_SECONDS})"}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "str_replace_editor",
        "description": "View, create and edit files. view: a file with line numbers (view_range [first, last] "
        "optional, last -1 = to the end) or a directory two levels deep; create: write file_text to a new file; "
        "str_replace: replace old_str, which must occur exactly once in the file, with new_str; insert: insert "
        "new_str after line insert_line (0 = at the top).",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert"]},
            "path": {"type": "string", "description": "absolute path, e.g. /testbed/src/module.py"},
            "file_text": {"type": "string"}, "old_str": {"type": "string"}, "new_str": {"type": "string"},
            "insert_line": {"type": "integer"}, "view_range": {"type": "array", "items": {"type": "integer"}}},
            "required": ["command", "path"]}}},
    {"type": "function", "function": {
        "name": "submit",
        "description": "End the episode once you are done: the final state of /testbed is graded.",
        "parameters": {"type": "object", "properties": {}}}},
]


def swe_toolbox(row: dict, limits: containers.ContainerLimits = SWE_CONTAINER,
                pool: containers.ContainerPool | None = None) -> ToolBox:
    """`bash`, `str_replace_editor` and `submit` in one fresh container from the row's SWE-bench instance image, taken
    from `pool` (default: containers.shared_pool(); pre-started there by prestart_swe, or started now). On close the
    container's diff since the base commit becomes the sample's completion (what rewards.score grades in a fresh
    container; "" and info["diff_error"] when the agent left no usable diff; info["infra_failed"] when the container
    or daemon failed) and the container is removed, whatever happens. info["container_seconds"]: time spent in Docker
    (waiting for the container, commands, diff, removal); info["container_wait"]: of it, waiting for the container."""
    truth = json.loads(row["reward_model"]["ground_truth"])
    start = time.perf_counter()
    container = (pool or containers.shared_pool()).take(truth["image"], truth["instance_id"], limits)
    waited = time.perf_counter() - start
    info = {"container_seconds": waited, "container_wait": waited}
    timed = functools.partial(_timed, info)

    def close() -> None:
        begin = time.perf_counter()
        try:
            diff = containers.container_diff(container, truth["base_commit"])
            info["completion"] = diff.decode(errors="surrogateescape")  # rewards.score encodes it back byte for byte
        except containers.DiffError as e:
            info["completion"], info["diff_error"] = "", str(e)
        except containers.InfraFailure as e:
            info["completion"], info["infra_failed"] = "", str(e)
        finally:
            container.remove()
            info["container_seconds"] += time.perf_counter() - begin

    tools = {"bash": timed(lambda arguments: swe_bash(container, arguments)),
             "str_replace_editor": timed(lambda arguments: swe_editor(container, arguments)),
             "submit": lambda arguments: ToolResult("Submitted: /testbed will be graded.", stop=True)}
    return ToolBox(tools, SWE_TOOLS, close=close, info=info)


def _timed(info: dict, tool: Callable[[dict], ToolResult]) -> Callable[[dict], ToolResult]:
    """`tool`, its wall seconds added to info["container_seconds"]."""
    def run(arguments: dict) -> ToolResult:
        begin = time.perf_counter()
        try:
            return tool(arguments)
        finally:
            info["container_seconds"] += time.perf_counter() - begin
    return run


def _described(tool: dict, description: str) -> dict:
    return {"type": "function", "function": tool["function"] | {"description": description}}


TASK_TOOLS = [
    _described(SWE_TOOLS[0], "Run one bash command in the task's working directory, without network. It is killed "
               "after `timeout` seconds; only files persist between calls (no cd, no variables, no background "
               "jobs); long output keeps its head and tail."),
    SWE_TOOLS[1],
    _described(SWE_TOOLS[2], "End the episode once you are done: the task's tests then check the container."),
]


def task_toolbox(row: dict, limits: containers.ContainerLimits = SWE_CONTAINER) -> ToolBox:
    """`bash`, `str_replace_editor` and `submit` in a fresh container of a task directory's image (task_dirs), for at
    most the task's [agent].timeout_sec (then every call ends the episode). On close the task's tests run in that
    container (task_dirs.verify; its Verdict in info["task_verdict"], what rewards.task_reward reads) and the container
    is removed, whatever happens. The sample's completion is what the agent did as a script (its commands and the
    files the editor wrote), which `python rewards.py score` replays in a fresh container."""
    truth = task_dirs.truth_of(row)
    start = time.perf_counter()
    task = task_dirs.start(containers.shared_client(), truth, limits=limits)
    deadline = time.monotonic() + task.spec.agent_timeout
    info, replay = {"container_seconds": time.perf_counter() - start}, ["#!/bin/bash"]
    timed = functools.partial(_timed, info)

    def in_time(tool: Callable[[dict], ToolResult]) -> Callable[[dict], ToolResult]:
        def run(arguments: dict) -> ToolResult:
            if time.monotonic() >= deadline:
                info["agent_timeout"] = True
                return ToolResult(f"Time is up ({task.spec.agent_timeout:g} s): the tests now run.", stop=True)
            return tool(arguments)
        return run

    def bash(arguments: dict) -> ToolResult:
        timeout = arguments.get("timeout", task.box.limits.timeout)
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:  # cut to the time left
            arguments = arguments | {"timeout": min(timeout, max(deadline - time.monotonic(), 1.0))}
        result = swe_bash(task.box, arguments)
        if result.text.startswith("<returncode>"):  # it ran
            replay.append(task_dirs.replay_command(arguments["command"], arguments["timeout"]))
        return result

    def editor(arguments: dict) -> ToolResult:
        result = swe_editor(task.box, arguments)
        if not result.error and arguments.get("command") != "view":  # a file was written: its bytes and mode
            path = arguments["path"]
            mode = task.box.exec(f"stat -c %a {shlex.quote(path)}", user="0").output.strip()
            replay.append(task_dirs.replay_file(path, task.box.get_file(path), mode))
        return result

    def close() -> None:
        begin = time.perf_counter()
        try:
            info["task_verdict"] = dataclasses.asdict(task_dirs.verify(task))
        finally:
            task.box.remove()
            info["container_seconds"] += time.perf_counter() - begin
            info["completion"] = "\n".join(replay) + "\n"

    tools = {"bash": timed(in_time(bash)), "str_replace_editor": timed(in_time(editor)),
             "submit": lambda arguments: ToolResult("Submitted: the task's tests will run.", stop=True)}
    return ToolBox(tools, TASK_TOOLS, close=close, info=info)


def container_toolbox(row: dict) -> ToolBox:
    """`--tools swe`: the toolbox of the row's container, a SWE-bench instance's or a task directory's."""
    return task_toolbox(row) if row["data_source"] == task_dirs.DATA_SOURCE else swe_toolbox(row)


def prestart_swe(rows: list[dict], group_size: int, limits: containers.ContainerLimits = SWE_CONTAINER) -> None:
    """Start the containers of `group_size` trajectories of each swebench row in containers.shared_pool() now, in the
    background, so that swe_toolbox finds them running (the next step's, while this one trains). Task directories'
    rows start theirs when their trajectory does (task_dirs.start)."""
    wanted = [(truth["image"], truth["instance_id"]) for truth in
              (json.loads(row["reward_model"]["ground_truth"]) for row in rows if row["data_source"] == "swebench")
              for _ in range(group_size)]
    containers.shared_pool().prestart(wanted, limits)


def swe_bash(container: containers.Container, arguments: dict) -> ToolResult:
    """One command, mini-swe-agent's observation format; a timeout is a tool error, a failing command is not."""
    command, timeout = arguments.get("command"), arguments.get("timeout", container.limits.timeout)
    if not isinstance(command, str) or not command.strip():
        return ToolResult('Error: bash needs {"command": <non-empty string>}', error=True)
    if not isinstance(timeout, (int, float)) or not 0 < timeout <= SWE_MAX_COMMAND_SECONDS:
        return ToolResult(f"Error: timeout must be a number of seconds in (0, {SWE_MAX_COMMAND_SECONDS}]", error=True)
    result = container.exec(command, timeout=timeout)
    killed = f"<warning>killed after {timeout} s</warning>\n" if result.timed_out else ""
    return ToolResult(f"<returncode>{result.exit_code}</returncode>\n{killed}<output>\n{result.output}</output>",
                      error=result.timed_out)


def swe_editor(container: containers.Container, arguments: dict) -> ToolResult:
    """SWE-agent's str_replace_editor (view, create, str_replace, insert) on the container's files."""
    command, path = arguments.get("command"), arguments.get("path")
    if not isinstance(path, str) or not path.startswith("/") or path == "/tmp" or path.startswith("/tmp/"):
        return ToolResult("Error: path must be an absolute path outside /tmp, e.g. /testbed/src/module.py", error=True)
    quoted = shlex.quote(path)
    if command == "view":
        view_range = arguments.get("view_range") or [1, -1]
        if not (isinstance(view_range, list) and len(view_range) == 2 and all(type(v) is int for v in view_range)):
            return ToolResult("Error: view_range must be two line numbers [first, last]", error=True)
        first, last = view_range
        shown = container.exec(f"if [ -d {quoted} ]; then find {quoted} -maxdepth 2 -not -path '*/.*' | sort; "
                               f"else awk -v a={first} -v b={last} 'NR >= a && (b < 0 || NR <= b) "
                               f"{{printf \"%6d\\t%s\\n\", NR, $0}}' {quoted}; fi")
        return ToolResult(shown.output or "(empty)", error=shown.exit_code != 0)
    if command == "create":
        if not isinstance(arguments.get("file_text"), str):
            return ToolResult("Error: create needs file_text", error=True)
        made = container.exec(f"test ! -e {quoted} && mkdir -p \"$(dirname {quoted})\"")
        if made.exit_code != 0:
            return ToolResult(f"Error: {path} exists already (edit it with str_replace or insert)", error=True)
        container.put_file(path, arguments["file_text"].encode())
        return ToolResult(f"Created {path}.")
    if command not in ("str_replace", "insert"):
        return ToolResult("Error: command must be one of view, create, str_replace, insert", error=True)
    mode = container.exec(f"test -f {quoted} && stat -c %a {quoted}")
    if mode.exit_code != 0:
        return ToolResult(f"Error: {path} is not a file", error=True)
    try:
        text = container.get_file(path).decode()
    except UnicodeDecodeError:
        return ToolResult(f"Error: {path} is not UTF-8 text; edit it with bash", error=True)
    new_str = arguments.get("new_str")
    if not isinstance(new_str, str):
        return ToolResult(f"Error: {command} needs new_str", error=True)
    if command == "str_replace":
        old_str = arguments.get("old_str")
        if not isinstance(old_str, str) or not old_str:
            return ToolResult("Error: str_replace needs a non-empty old_str", error=True)
        count = text.count(old_str)
        if count != 1:
            return ToolResult(f"Error: old_str occurs {count} times in {path}; it must occur exactly once", error=True)
        text = text.replace(old_str, new_str)
    else:
        lines, at = text.splitlines(keepends=True), arguments.get("insert_line")
        if not isinstance(at, int) or not 0 <= at <= len(lines):
            return ToolResult(f"Error: insert_line must be a line number in [0, {len(lines)}]", error=True)
        text = "".join(lines[:at]) + new_str + ("" if new_str.endswith("\n") else "\n") + "".join(lines[at:])
    container.put_file(path, text.encode(), mode=int(mode.output.split()[-1], 8))
    return ToolResult(f"Edited {path}.")


def check_swe_rows(rows: list[dict], tools: str, source: str) -> None:
    """swebench and task rows need the swe toolbox and it needs them; each swebench row's image must be on the Docker
    host, and each task's is built now if it is not. Checked at load, before any model is."""
    sources = list(task_rows.values(rows, "data_source"))
    swe = [i for i, data_source in enumerate(sources) if data_source == "swebench"]
    tasks = [i for i, data_source in enumerate(sources) if data_source == task_dirs.DATA_SOURCE]
    if (swe or tasks) and tools != "swe" or tools == "swe" and len(swe) + len(tasks) < len(rows):
        raise ValueError(f"{source}: swebench and task rows run with --tools swe and --tools swe runs only those "
                         f"({len(swe)} swebench and {len(tasks)} task rows of {len(rows)}, --tools {tools})")
    if tools == "swe":
        swe_grading.check_images([json.loads(rows[i]["reward_model"]["ground_truth"]) for i in swe], source)
        if tasks:
            task_dirs.ensure_images([task_dirs.truth_of(rows[i]) for i in tasks])


TOOLBOXES: dict[str, Callable[[dict], ToolBox]] = {"python": python_toolbox, "codev": codev_toolbox,
                                                   "swe": container_toolbox}


TOOL_SCHEMAS: dict[str, list[dict]] = {"python": [PYTHON_TOOL], "codev": [], "swe": SWE_TOOLS}  # shown in the prompt
