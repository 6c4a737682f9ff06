"""Executes every tutorial notebook headless, at its small size, as CI does.

    python docs/tutorials/run_tutorials.py               # all, small size
    python docs/tutorials/run_tutorials.py dp_sgd        # one (name or path)
    python docs/tutorials/run_tutorials.py --full        # full size (by hand)

`make tutorials` runs the first form. Each notebook runs in a fresh kernel
whose Python environment does *not* contain kdpemb: a virtual environment
in `build/tutorials/venv` that sees the packages of the running
interpreter (Keras, TensorFlow, JAX, dp-accounting, ...) through a `.pth`
path line, which does not process that environment's own `.pth` files, so
an editable kdpemb there is invisible; it is made anew for each notebook.
The notebook's first code cell then installs kdpemb as on Colab, with
`%pip install`, from
`KDPEMB_INSTALL_SOURCE` = this working tree (`--no-deps`: the
dependencies are there already). The runner checks beforehand that
`import kdpemb` fails in that environment, so a notebook passes only if
its own first cell installed the package.

Notebooks run under JAX (`KERAS_BACKEND=jax`) with
`KDPEMB_TUTORIAL_SMALL=1` and `KDPEMB_TUTORIAL_OFFLINE=1` (no download:
Fashion-MNIST from local files, else the notebook's synthetic fallback),
each in its own working directory under `build/tutorials/work/`, with a
time limit per notebook. A cell error or a time-out fails the run; the
executed copies (as far as they ran) are written to
`build/tutorials/executed/` (the notebooks
in the repository keep no outputs: tests/test_tutorials_clean.py). Each
notebook's wall time is printed.
"""

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import time

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BUILD = ROOT / "build" / "tutorials"
KERNEL = "kdpemb-tutorials"
SMALL_LIMIT_S = 240  # per notebook; each takes well under a minute alone.
FULL_LIMIT_S = 4 * 3600


def notebooks(names):
    every = sorted(HERE.glob("*.ipynb"))
    if not names:
        return every
    chosen = []
    for name in names:
        stem = pathlib.Path(name).stem
        match = [path for path in every if path.stem == stem]
        if not match:
            known = ", ".join(path.stem for path in every)
            raise SystemExit(f"no tutorial named {name!r}; there are: {known}")
        chosen += match
    return chosen


def kernel_environment():
    """A new venv without kdpemb that sees this interpreter's packages; its
    kernel spec."""
    venv = BUILD / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True
    )
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    pathlib.Path(site, "kdpemb_tutorials_host.pth").write_text(
        "".join(f"{path}\n" for path in sorted(ours))
    )
    spec = BUILD / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    argv = [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "kdpemb tutorials", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    return venv


def environment(venv, small):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # The source tree must not be importable.
    env.update(
        JUPYTER_PATH=str(BUILD / "jupyter"),
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
        KDPEMB_INSTALL_SOURCE=ROOT.as_uri(),
        KDPEMB_PIP_OPTIONS="--no-deps --force-reinstall",
        KDPEMB_TUTORIAL_SMALL="1" if small else "0",
        KDPEMB_TUTORIAL_OFFLINE="1",
        KERAS_BACKEND=env.get("KERAS_BACKEND", "jax"),
        TF_CPP_MIN_LOG_LEVEL="2",
        MPLBACKEND="module://matplotlib_inline.backend_inline",
        PYTHONWARNINGS="ignore::DeprecationWarning",
    )
    # As `make test-jax`: XLA's CPU code at -O1, compiled programs cached.
    cache = ROOT / "build" / "jax-compilation-cache"
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    env["XLA_FLAGS"] = (
        "--xla_backend_optimization_level=1 " + env.get("XLA_FLAGS", "")
    ).strip()
    return env


def check_not_installed(venv, env, workdir):
    found = subprocess.run(
        [venv / "bin" / "python", "-c", "import kdpemb; print(kdpemb.__file__)"],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    if found.returncode == 0:
        raise SystemExit(
            "kdpemb is importable in the tutorials' kernel before any notebook "
            f"installed it ({found.stdout.strip()}): the first cells would not "
            "be tested"
        )


async def execute(notebook, workdir, limit):
    client = NotebookClient(
        notebook,
        kernel_name=KERNEL,
        timeout=limit,
        resources={"metadata": {"path": str(workdir)}},
    )
    await asyncio.wait_for(client.async_execute(), timeout=limit)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks (default: all)")
    parser.add_argument("--full", action="store_true", help="full size (by hand)")
    parser.add_argument("--limit", type=float, default=None, help="s per notebook")
    args = parser.parse_args(argv)
    limit = args.limit or (FULL_LIMIT_S if args.full else SMALL_LIMIT_S)
    paths = notebooks(args.names)
    started = time.perf_counter()
    venv = BUILD / "venv"
    os.environ.update(environment(venv, small=not args.full))
    os.environ.pop("PYTHONPATH", None)
    (BUILD / "executed").mkdir(parents=True, exist_ok=True)
    failures, times = [], {}
    for path in paths:
        workdir = BUILD / "work" / path.stem
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        kernel_environment()  # Anew: the last notebook installed kdpemb.
        check_not_installed(venv, os.environ, workdir)
        print(f"{path.relative_to(ROOT)} ...", flush=True)
        notebook = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        try:
            asyncio.run(execute(notebook, workdir, limit))
        except TimeoutError:
            failures.append(f"{path.name}: more than {limit:g} s")
        except Exception as error:  # A cell's error: its traceback, then on.
            print(str(error)[-4000:], file=sys.stderr)
            failures.append(f"{path.name}: {type(error).__name__}")
        nbformat.write(notebook, BUILD / "executed" / path.name)  # As far as it ran.
        times[path.name] = time.perf_counter() - start
        print(f"  {times[path.name]:.1f} s", flush=True)
    total = time.perf_counter() - started
    print(f"{len(paths)} notebook(s) in {total:.1f} s: "
          + ", ".join(f"{name} {s:.1f} s" for name, s in times.items()))  # fmt: skip
    if failures:
        raise SystemExit("failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
