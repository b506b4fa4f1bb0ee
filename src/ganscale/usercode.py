"""The user's own code, named "module:attribute" in the config, found the same way in every process.

Modules are searched in the config's `code_path` (the YAML file's folder among them), then the current
directory, then PYTHONPATH. A name that does not import, or a factory that refuses its arguments, is a
ConfigError naming the key.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Sequence
from typing import Any

from ganscale.config import ConfigError


def search(code_path: Sequence[str]) -> None:
    """Put the config's folders, then the current directory, first on this process's module search path."""
    for folder in reversed([*code_path, os.getcwd()]):
        if folder not in sys.path:
            sys.path.insert(0, folder)


def find(spec: str, key: str, code_path: Sequence[str] = ()) -> Any:
    """The object `spec` ("module:attribute", the attribute possibly dotted) names."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(key, f"'{spec}' is not of the form module:attribute", "e.g. my_gan.nets:Generator")
    search(code_path)
    try:
        found = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - the module's own error while importing is the user's to see
        raise ConfigError(key, f"'{module_name}' does not import ({one_line(e)})",
                          "put the module beside the YAML file, in the current directory, on PYTHONPATH or in a "
                          "code_path folder, and fix its import") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError(key, f"'{module_name}' has no attribute '{attribute}'",
                              f"name a class or function defined in {module_name}")
        found = getattr(found, part)
    return found


def factory(spec: str, key: str, code_path: Sequence[str] = ()) -> Any:
    """The class or function `spec` names."""
    found = find(spec, key, code_path)
    if not (inspect.isclass(found) or inspect.isfunction(found)):
        raise ConfigError(key, f"'{spec}' is a {type(found).__name__}, not a class or a function",
                          "name a class, or a function that builds the object")
    return found


def build(spec: str, args: dict[str, Any], key: str, code_path: Sequence[str] = ()) -> Any:
    """What the factory `spec` returns for the keyword arguments `args` (the option `key`_args)."""
    make = factory(spec, key, code_path)
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
        raise ConfigError(f"{key}_args", f"{spec}(**{args}) failed ({one_line(e)})",
                          f"give {key}_args values {spec} accepts") from None


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
