"""``--help`` text: the program's usage, its flags, and the config file's fields with their
defaults and one-line meanings, read from the comments above each ``config.FIELD = ...`` line
of the config file (the file is the schema)::

  python -m tpipe.train --config=configs/lm.py --help
  python -m tpipe.train --config=configs/lm.py:size=tiny --help     # that size's defaults

A field's meaning is the first sentence of the comment block directly above its assignment (or
the comment at the end of the line); fields assigned right after a commented one, with no blank
line between, refer to it ("see FIELD").
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import textwrap

# Where the example configs live in a source checkout.
CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def config_spec(argv: list[str]) -> str | None:
  """The value of ``--config`` in ``argv`` (``--config=PATH[:ARG]`` or ``--config PATH``)."""
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _target_name(node: ast.expr) -> str | None:
  """``"a.b"`` for an assignment target ``config.a.b``, else None."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name) and node.id == "config" and parts:
    return ".".join(reversed(parts))
  return None


def _first_sentence(text: str) -> str:
  text = " ".join(text.split())
  match = re.search(r"(?<=\.)\s", text)
  sentence = text[:match.start()] if match else text
  return sentence if len(sentence) <= 200 else sentence[:197].rstrip() + "..."


def field_meanings(source: str) -> dict[str, str]:
  """``{field: meaning}`` from a config file's source (see the module docstring), in the order
  the file assigns the fields."""
  lines = source.splitlines()
  meanings, group = {}, None
  assignments = sorted((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Assign)),
                       key=lambda n: n.lineno)
  for node in assignments:
    for target in node.targets:
      name = _target_name(target)
      if name is None:
        continue
      row = node.lineno - 1
      comment = []
      above = row - 1
      while above >= 0 and lines[above].strip().startswith("#"):
        comment.insert(0, lines[above].strip().lstrip("#").strip())
        above -= 1
      trailing = re.search(r"#\s*(.*)$", lines[row]) if "#" in lines[row] else None
      if comment:
        meanings[name], group = _first_sentence(" ".join(comment)), (name, row)
      elif trailing:
        meanings[name] = _first_sentence(trailing.group(1))
      elif group and all(lines[r].strip() for r in range(group[1], row)):
        meanings[name] = f"see {group[0]}"
      else:
        meanings[name] = ""
      nested = isinstance(node.value, ast.Call) and node.value.args and isinstance(
          node.value.args[0], ast.Dict)
      if nested:  # config.mesh = ConfigDict({...})
        for key in node.value.args[0].keys:
          if isinstance(key, ast.Constant):
            meanings.setdefault(f"{name}.{key.value}", meanings.get(name, ""))
  return meanings


def _flatten(config, prefix: str = "") -> dict[str, object]:
  out = {}
  for key, value in config.items():
    if hasattr(value, "items"):
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _load(path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(f"tpipe_help_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def config_fields(spec: str) -> str:
  """The fields of the config file ``spec`` (``PATH[:ARG]``), one per entry: name, default and
  meaning."""
  path_text, _, arg = spec.partition(":")
  path = pathlib.Path(path_text)
  if not path.is_file():
    raise ValueError(f"--config={spec}: no such config file {path_text!r}.")
  config = _load(path).get_config(arg or None)
  meanings = field_meanings(path.read_text())
  out = [f"Config fields of {spec} (set any with --config.NAME=VALUE):"]
  values = _flatten(config)
  order = list(meanings) + sorted(values)
  for name in sorted(values, key=order.index):
    value = values[name]
    out.append(f"  --config.{name}={value!r}")
    meaning = meanings.get(name) or meanings.get(name.split(".")[0], "")
    if meaning:
      out.extend(textwrap.wrap(meaning, 96, initial_indent="      ",
                               subsequent_indent="      "))
  return "\n".join(out)


def help_text(doc: str, argv: list[str]) -> str:
  """The full ``--help``: ``doc``, the program's own flags, and the config's fields (of
  ``--config`` if given, else ``configs/lm.py``)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  parts = [doc.strip()]
  own = [f for f in flags.FLAGS.flags_by_module_dict().items()
         if f[0].startswith("tpipe.") or f[0] == "__main__"]
  flag_lines = [f"  --{flag.name}: {flag.help}" for _, module_flags in own
                for flag in module_flags]
  if flag_lines:
    parts.append("Flags:\n" + "\n".join(dict.fromkeys(flag_lines)))
  spec = config_spec(argv)
  takes_config = "config" in flags.FLAGS
  if spec is None and takes_config and (CONFIGS / "lm.py").is_file():
    spec = str(CONFIGS / "lm.py")
  if spec is not None:
    try:
      parts.append(config_fields(spec))
    except Exception as error:  # pylint: disable=broad-except  # Help must not crash.
      parts.append(f"(cannot list the config's fields: {type(error).__name__}: {error})")
  return "\n\n".join(parts)
