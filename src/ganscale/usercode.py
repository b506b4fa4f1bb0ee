"""The user's own code, named "module:attribute" in the config, found the same way in every process.

Modules are searched in the config's `code_path` (the YAML file's folder and the current directory where the
run started among them, config.load), then PYTHONPATH; only for a config that names such code
(`Config.names_user_code`), so a shipped recipe never imports a file that happens to lie in the current directory,
and a resume from another folder never one that lies there. A name that does not import, or a
factory that refuses its arguments, is a ConfigError naming the key.

A config is data that can come from elsewhere (a run directory read by sample, eval or export), so what it names
must be the user's own code: never a function or class of Python's standard library or of an installed package
(`subprocess:run` would run a command), except an installed nn.Module class as a network.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import site
import sys
import sysconfig
import traceback
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from torch import nn

from ganscale.config import ConfigError


_searched: list[str] = []  # the config folders `search` put first on the module search path, in order


def search(code_path: Sequence[str]) -> None:
    """Put the config's folders first on this process's module search path."""
    for folder in reversed(code_path):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    _searched[:0] = [folder for folder in code_path if folder not in _searched]


def find(spec: str, key: str, code_path: Sequence[str] = (), network: bool = False) -> Any:
    """The object `spec` ("module:attribute", the attribute possibly dotted) names: defined in the user's own code,
    or, for a `network`, an nn.Module class of an installed package."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(key, f"'{spec}' is not of the form module:attribute", "e.g. my_gan.nets:Generator")
    search(code_path)
    try:
        top = importlib.util.find_spec(module_name.partition(".")[0])  # imports nothing
    except (ImportError, ValueError):  # not a module name (".nets"): the import below says so
        top = None
    if top is not None and _where(top.origin) == STDLIB:  # refused before it imports (antigravity opens a browser)
        raise _not_users_own(spec, key, f"a module of {STDLIB}")
    try:
        found = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - the module's own error while importing is the user's to see
        raised = raised_at(e)
        missing = isinstance(e, ModuleNotFoundError) and e.name and f"{module_name}.".startswith(f"{e.name}.")
        if raised and not missing:  # found, but its code (or a module it imports) raised
            raise ConfigError(key, f"'{module_name}' does not import ({one_line(e)})",
                              f"fix the error at {raised}") from None
        # A run's own config (a resume, sample, export) searches the folders it recorded, not the current one.
        where = f"in a code_path folder ({', '.join(_searched)})" if _searched else "in a code_path folder"
        raise ConfigError(key, f"'{module_name}' does not import ({one_line(e)})",
                          f"put the module {where} or on PYTHONPATH, and fix its import") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError(key, f"'{module_name}' has no attribute '{attribute}'",
                              f"name a class or function defined in {module_name}")
        found = getattr(found, part)
    if network and inspect.isclass(found) and issubclass(found, nn.Module):
        return found
    defined = found if inspect.isclass(found) or inspect.isroutine(found) else sys.modules[module_name]
    try:
        file = inspect.getfile(defined)
    except TypeError:  # built into the interpreter
        file = None
    where = _where(file)
    if where != USERS:
        raise _not_users_own(spec, key, f"defined in {where}")
    return found


def _not_users_own(spec: str, key: str, where: str) -> ConfigError:
    network = " (or, as a network, an nn.Module class of an installed package)" if key.startswith("model.") else ""
    return ConfigError(key, f"'{spec}' is {where}: a config names only your own code{network}, since a config "
                       "(a run directory's too) could otherwise make ganscale call any function",
                       "define it in a module of your own (beside the YAML file or in a code_path folder); "
                       "a wrapper of a few lines will do")


STDLIB, INSTALLED, USERS = "Python's standard library", "an installed package", "the user's code"


def _where(file: str | None) -> str:
    """Whose code a file (a module's origin; None, 'built-in' or 'frozen': the interpreter's) is: STDLIB, INSTALLED
    (site-packages, ganscale itself) or USERS."""
    if file is None or not os.path.isabs(file):
        return STDLIB
    path = Path(file).resolve()
    installed, stdlib = _library_folders()
    if any(path.is_relative_to(folder) for folder in installed):  # first: site-packages may lie inside stdlib's
        return INSTALLED
    return STDLIB if any(path.is_relative_to(folder) for folder in stdlib) else USERS


@cache
def _library_folders() -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """(installed packages' folders, the standard library's)."""
    paths = sysconfig.get_paths()
    installed = {paths["purelib"], paths["platlib"], *site.getsitepackages(), site.getusersitepackages(),
                 str(Path(__file__).parent)}
    installed |= {entry for entry in sys.path if Path(entry).name in ("site-packages", "dist-packages")}
    stdlib = {paths["stdlib"], paths["platstdlib"]}
    return tuple(Path(f).resolve() for f in installed), tuple(Path(f).resolve() for f in stdlib)


def factory(spec: str, key: str, code_path: Sequence[str] = (), network: bool = False) -> Any:
    """The class or function `spec` names."""
    found = find(spec, key, code_path, network)
    if not (inspect.isclass(found) or inspect.isfunction(found)):
        raise ConfigError(key, f"'{spec}' is a {type(found).__name__}, not a class or a function",
                          "name a class, or a function that builds the object")
    return found


def build(spec: str, args: dict[str, Any], key: str, code_path: Sequence[str] = (), network: bool = False) -> Any:
    """What the factory `spec` returns for the keyword arguments `args` (the option `key`_args)."""
    make = factory(spec, key, code_path, network)
    try:
        inspect.signature(make).bind(**args)
    except TypeError as e:
        raise ConfigError(f"{key}_args", f"{spec} refuses the arguments {args} ({e})",
                          f"give {key}_args the keyword arguments {spec} takes") from None
    except ValueError:  # no signature to read (a builtin): the call says
        pass
    try:
        return make(**args)
    except Exception as e:  # noqa: BLE001 - the factory refusing a value is the user's to see, on one line
        raised = raised_at(e)
        raise ConfigError(f"{key}_args", f"{spec}(**{args}) failed ({one_line(e)})",
                          f"give {key}_args values {spec} accepts" + (f", or fix the error at {raised}" if raised
                                                                     else "")) from None


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def raised_at(error: BaseException) -> str | None:
    """Where in the user's code `error` was raised: its traceback's innermost frame in the user's code (not the
    standard library's, an installed package's or ganscale's), as "file:line in function", the file relative to the
    current directory when under it; a SyntaxError's own file and line. None: raised outside the user's code."""
    found = [(frame.f_code.co_filename, line, f" in {frame.f_code.co_name}")
             for frame, line in traceback.walk_tb(error.__traceback__)]
    if isinstance(error, SyntaxError) and error.filename and error.lineno:  # its frames are importlib's
        found.append((error.filename, error.lineno, ""))
    return _innermost_users(found)


def called_at() -> str | None:
    """Where in the user's code the running call was made, as raised_at says it; None: not from the user's code."""
    return _innermost_users([(frame.filename, frame.lineno, f" in {frame.name}")
                             for frame in traceback.extract_stack()])


def _innermost_users(frames: list[tuple[str, int, str]]) -> str | None:
    """The last of (file, line, " in function") frames in the user's code, as "file:line in function"."""
    for file, line, function in reversed(frames):
        path = os.path.abspath(file) if os.path.exists(file) else file  # "<string>": the interpreter's
        if _where(path) == USERS:
            shown = os.path.relpath(path) if Path(path).is_relative_to(os.getcwd()) else path
            return f"{shown}:{line}{function}"
    return None
