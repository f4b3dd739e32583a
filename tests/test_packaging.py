"""What a user gets from ``pip install .`` (issue 38): a wheel with the LICENSE, a ``py.typed`` marker that
mypy honours from an installed copy, the configs, and no scikit-learn unless the ``demo`` extra asks for it.

The wheel is built from a copy of the sources in a temporary folder (setuptools writes ``build/`` beside
the sources), with the running environment's setuptools (no download).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "configs", src / "configs")
    shutil.copytree(REPO / "lightning_spdkfac", src / "lightning_spdkfac", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "-w", str(out), str(src)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    (whl,) = out.glob("lightning_spdkfac-*.whl")
    return whl


def _metadata(whl: Path) -> list[str]:
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode().splitlines()


def test_the_wheel_holds_the_license_py_typed_and_the_configs(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        licenses = [n for n in names if n.endswith("/LICENSE") and ".dist-info/" in n]
        assert licenses, sorted(names)[:20]
        text = z.read(licenses[0]).decode()
    assert text == (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert "lightning_spdkfac/py.typed" in names
    assert {"lightning_spdkfac/configs/digits.yaml", "lightning_spdkfac/configs/hf_gpt2.yaml"} <= names
    assert "License-File: LICENSE" in _metadata(wheel)


def test_scikit_learn_is_required_by_the_demo_extra_only(wheel):
    requires = [line.removeprefix("Requires-Dist: ") for line in _metadata(wheel) if line.startswith("Requires-Dist:")]
    sklearn = [r for r in requires if r.lower().startswith("scikit-learn")]
    assert sklearn and all('extra == "demo"' in r for r in sklearn), requires
    unconditional = [r for r in requires if "extra ==" not in r]
    assert not any(r.lower().startswith(("scikit-learn", "scipy", "joblib")) for r in unconditional), unconditional


USER_SCRIPT = """\
from lightning_spdkfac import KFAC

callback = KFAC()
reveal_type(callback)
KFAC(damping="0.03")
"""


def test_mypy_reads_the_types_of_an_installed_copy(wheel, tmp_path):
    """A user's script type-checked against the wheel installed into a fresh environment (no source path):
    without py.typed mypy would see ``KFAC`` as ``Any`` and accept a string damping."""
    pytest.importorskip("mypy")
    env = tmp_path / "venv"
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base if base.exists() else sys.executable), "-m", "venv", "--without-pip", str(env)],
                   check=True, timeout=120)
    python = env / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert purelib != sysconfig.get_paths()["purelib"]
    with zipfile.ZipFile(wheel) as z:
        z.extractall(purelib)
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    p = subprocess.run([sys.executable, "-m", "mypy", "--python-executable", str(python), "--ignore-missing-imports",
                        "--no-incremental", "--cache-dir", str(tmp_path / "cache"), str(script)],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert 'Revealed type is "lightning_spdkfac.lightning.callback.KFAC"' in out, out
    assert 'Argument "damping" to "KFAC" has incompatible type "Literal[\'0.03\']"' in out, out  # (not "auto")
