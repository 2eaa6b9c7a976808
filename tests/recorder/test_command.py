"""The user's command as the record keeps it (recorder/command.py): which module files are the user's."""

from __future__ import annotations

import sys
import sysconfig
import types
from pathlib import Path

from replay.recorder import command


def _user_files_resolving_each_path() -> list[Path]:
    """`command._user_files` as it was written first: every module's path resolved from its start."""
    installed = {Path(p).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")
                 if (p := sysconfig.get_paths().get(key))}
    installed |= {Path(p).resolve() for p in sys.path if "site-packages" in p or "dist-packages" in p}
    installed.add(Path(sys.prefix).resolve())
    installed.add(Path(sys.base_prefix).resolve())
    installed.add(Path(command.__file__).resolve().parents[1])
    files = []
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
    if script is not None and script.is_file():
        files.append(script)
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if not name or not name.endswith(".py"):
            continue
        path = Path(name).resolve()
        if path.is_file() and path not in files and not any(path.is_relative_to(root) for root in installed):
            files.append(path)
    return files


def test_the_user_files_are_those_of_resolving_every_module_path(tmp_path, monkeypatch):
    """This process's thousands of modules, and modules of a user's own reached through links: a linked folder,
    a linked file into an installed package (not the user's), a linked file out of one, a relative path, a
    path through `..`, a missing file: the same files, in the same order, as resolving each path."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "mine.py").write_text("x = 1\n")
    (real / "also.py").write_text("y = 2\n")
    (tmp_path / "linked").symlink_to(real, target_is_directory=True)
    (real / "sub").mkdir()
    (real / "up.py").write_text("u = 4\n")
    (tmp_path / "deep").symlink_to(real / "sub", target_is_directory=True)   # deep/.. is real, not tmp_path
    installed_file = Path(sysconfig.get_paths()["stdlib"], "os.py").resolve()
    (real / "into_installed.py").symlink_to(installed_file)
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    outside = tmp_path / "outside.py"
    outside.write_text("z = 3\n")
    monkeypatch.chdir(tmp_path)
    paths = {"mine_linked": str(tmp_path / "linked" / "mine.py"), "also_relative": "real/also.py",
             "dotdot": str(tmp_path / "linked" / ".." / "real" / "mine.py"), "up": str(tmp_path / "deep/../up.py"),
             "into_installed": str(real / "into_installed.py"), "missing": str(real / "missing.py"),
             "site_link": str(site / "does-not-matter.py")}
    for name, path in paths.items():
        module = types.ModuleType(f"_test_command_{name}")
        module.__file__ = path
        monkeypatch.setitem(sys.modules, module.__name__, module)
    expected = _user_files_resolving_each_path()
    assert command._user_files() == expected
    assert real / "mine.py" in expected and real / "also.py" in expected and real / "up.py" in expected
    assert real / "into_installed.py" not in expected and installed_file not in expected


def test_the_imports_a_script_fork_server_takes_are_the_installed_top_level_packages(tmp_path, monkeypatch):
    """torch (installed) is named, once, by its top-level name; a module of the user's own (outside site-packages),
    a submodule and a private module are not."""
    local = types.ModuleType("my_local_module")
    local.__file__ = str(tmp_path / "my_local_module.py")
    monkeypatch.setitem(sys.modules, "my_local_module", local)
    names = command.installed_imports()
    assert "torch" in names and names.count("torch") == 1
    assert "my_local_module" not in names and "torch.nn" not in names
    assert not any(name.startswith("_") or "." in name for name in names)
