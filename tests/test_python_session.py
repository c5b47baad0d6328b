"""sandbox.PythonSession, the agent's Python tool: state persists, a timeout kills only that call, images come back as
PNG, the input image is available, it is isolated like reward programs (uid, view, no network, own processes only),
and no process survives session close or the death of the process that owns it."""
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


def processes_of(uid: int) -> list[str]:
    """Host pids of the processes running as `uid` (zombies too)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if int(status.split("\nUid:")[1].split()[0]) == uid:
            found.append(pid)
    return found


def gone(uid: int) -> bool:
    for _ in range(100):  # a killed process takes a moment to be reaped
        if not processes_of(uid):
            return True
        time.sleep(0.05)
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
        s.run("import os\nx = 7")
        pid = s.run("print(os.getpid())").stdout
        out = s.run("while True: pass", timeout=0.5)
        assert out.timed_out and out.error.startswith("timeout")
        assert s.run("print(x)").stdout == "7\n" and s.run("print(os.getpid())").stdout == pid  # same interpreter


def test_uninterruptible_call_gets_a_fresh_interpreter_and_says_so():
    with sandbox.PythonSession() as s:
        old_uid = int(s.run("import os\nx = 7\nprint(os.getuid())").stdout)
        out = s.run("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass", timeout=0.5)
        assert out.timed_out and "all state is lost" in out.error
        assert gone(old_uid)
        assert "NameError" in s.run("print(x)").error


def test_images_round_trip_as_png_with_input_image():
    with sandbox.PythonSession(input_images=[png("red")]) as s:
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


def test_the_session_is_isolated_like_reward_programs():
    with sandbox.PythonSession(input_images=[png("red")]) as s:
        out = s.run(f"""
import os, socket
print(os.getuid())
print(sorted(os.listdir('.')), os.path.exists({str(ROOT)!r}), os.path.exists({sys.prefix!r}))
print(sorted(p for p in os.listdir('/proc') if p.isdigit()) == [str(os.getpid())])
try:
    socket.create_connection(("1.1.1.1", 53), timeout=1)
    print("connected")
except OSError:
    print("no network")
""")
        uid, files, processes, network = out.stdout.splitlines()
        assert out.error is None and int(uid) >= s.sandbox.uid_base
        assert files == "['input_image.png'] False False"  # its working dir; neither the project nor the venv
        assert (processes, network) == ("True", "no network")  # only its own processes; no network


def test_no_process_survives_close():
    s = sandbox.PythonSession()
    uid = int(s.run("import os, subprocess\nprint(os.getuid())").stdout)
    s.run("subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
          "if os.fork() == 0:\n    os.setsid()\n"
          "    if os.fork() == 0:\n        os.execv('/bin/sleep', ['sleep', '60'])\n    os._exit(0)")
    assert len(processes_of(uid)) >= 3
    s.close()
    assert processes_of(uid) == []  # close() returns once they are gone


def test_no_process_survives_the_owner_being_killed():
    owner = subprocess.Popen([sys.executable, "-c", (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); import sandbox, time\n"
        "s = sandbox.PythonSession()\ns.run('import subprocess; subprocess.Popen([\"sleep\", \"60\"], "
        "start_new_session=True)')\nprint(s.run('import os; print(os.getuid())').stdout, flush=True)\n"
        "time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    uid = int(owner.stdout.readline())
    assert len(processes_of(uid)) == 2
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert gone(uid)  # the zygote dies with its owner, and its PID namespace with it
