"""sandbox.PythonSession, the agent's Python tool: state persists, a timeout kills only that call, images come back as
PNG, the input image is available, and no process survives session close or the death of the process that owns it."""
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sandbox  # noqa: E402


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def png(color, size=(6, 4)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_variables_imports_and_files_persist():
    with sandbox.PythonSession() as s:
        assert s.run("import math\nx = 41\nopen('notes.txt', 'w').write('kept')").error is None
        out = s.run("print(x + 1, math.floor(2.5), open('notes.txt').read())")
        assert out.stdout == "42 2 kept\n" and out.error is None


def test_stdout_stderr_and_exception_are_returned():
    with sandbox.PythonSession() as s:
        out = s.run("import sys\nprint('out')\nprint('err', file=sys.stderr)\nraise ValueError('bad value')")
        assert out.stdout == "out\n" and out.stderr == "err\n"
        assert out.error.endswith("ValueError: bad value\n") and 'File "<tool>", line 4' in out.error


def test_timeout_interrupts_only_that_call():
    with sandbox.PythonSession() as s:
        s.run("x = 7")
        pid = s.pid
        out = s.run("while True: pass", timeout=0.5)
        assert out.timed_out and out.error.startswith("timeout")
        assert s.run("print(x)").stdout == "7\n" and s.pid == pid  # same interpreter, state kept


def test_uninterruptible_call_gets_a_fresh_interpreter_and_says_so():
    with sandbox.PythonSession() as s:
        s.run("x = 7")
        old = s.pid
        out = s.run("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass", timeout=0.5)
        assert out.timed_out and "all state is lost" in out.error
        assert not alive(old) and s.pid != old
        assert "NameError" in s.run("print(x)").error


def test_images_round_trip_as_png_with_input_image():
    with sandbox.PythonSession(input_image=png("red")) as s:
        out = s.run("print(image.size, image.getpixel((0, 0)))\n"
                    "image.crop((0, 0, 3, 2)).show()\n"
                    "Image = type(image)\n"
                    "import PIL.Image\nPIL.Image.new('RGB', (2, 2), 'blue').save('blue.png')\n"
                    "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])")
        assert out.error is None and out.stdout == "(6, 4) (255, 0, 0)\n"
        assert len(out.images) == 3 and all(i.startswith(b"\x89PNG\r\n\x1a\n") for i in out.images)
        crop, saved, figure = (Image.open(io.BytesIO(i)) for i in out.images)
        assert crop.size == (3, 2) and crop.getpixel((0, 0)) == (255, 0, 0)
        assert saved.getpixel((1, 1)) == (0, 0, 255)
        assert figure.size == (640, 480)
        assert s.run("print(1)").images == []  # only images made by this call come back


def test_image_count_and_size_are_bounded():
    with sandbox.PythonSession(max_images=2) as s:
        out = s.run("import PIL.Image\nfor c in ['red', 'green', 'blue']: PIL.Image.new('RGB', (2, 2), c).show()")
        assert len(out.images) == 2 and "1 images dropped" in out.stderr
    with sandbox.PythonSession(max_image_bytes=100) as s:
        out = s.run("import PIL.Image, random\nPIL.Image.frombytes('L', (64, 64), random.randbytes(4096)).show()")
        assert out.images == [] and "1 images dropped" in out.stderr


def test_no_process_survives_close():
    s = sandbox.PythonSession()
    s.run("import subprocess\nchild = subprocess.Popen(['sleep', '60'])\nprint(child.pid)")
    pids = [s.pid, int(s.run("print(child.pid)").stdout)]
    tmp = s.tmp
    assert all(alive(p) for p in pids)
    s.close()
    for _ in range(100):  # SIGKILL of the group is delivered asynchronously
        if not any(alive(p) for p in pids):
            break
        time.sleep(0.05)
    assert not any(alive(p) for p in pids) and not os.path.exists(tmp)


def test_no_process_survives_the_owner_being_killed():
    owner = subprocess.Popen([sys.executable, "-c", (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); import sandbox, time\n"
        "s = sandbox.PythonSession()\nprint(s.pid, flush=True)\ntime.sleep(60)")], stdout=subprocess.PIPE, text=True)
    pid = int(owner.stdout.readline())
    assert alive(pid)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    for _ in range(100):  # the kernel delivers the parent-death signal asynchronously
        if not alive(pid):
            break
        time.sleep(0.05)
    assert not alive(pid)
