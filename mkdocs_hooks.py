"""MkDocs hook: the experiments index and result files are part of the site.

The pages under docs/ link to ``experiments/`` as it sits in the repository (``../experiments/``
from docs/, so the links also work when browsing the repository). This hook adds those files to
the site under ``experiments/`` and rewrites such links to point at them, so ``mkdocs build
--strict`` checks them like any other link.
"""

import pathlib
import posixpath
import re

from mkdocs.structure.files import File

_ROOT = pathlib.Path(__file__).resolve().parent
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def on_files(files, config):
  """Adds experiments/README.md and every file under experiments/results/."""
  experiments = _ROOT / "experiments"
  paths = [experiments / "README.md", *sorted((experiments / "results").rglob("*"))]
  for path in paths:
    if path.is_file():
      uri = path.relative_to(_ROOT).as_posix()
      files.append(File.generated(config, uri, abs_src_path=str(path)))
  return files


def on_page_markdown(markdown, page, config, files):
  """Rewrites links that leave docs/ for experiments/ into links inside the site."""
  if page.file.src_uri.startswith("experiments/"):
    return markdown
  page_dir = posixpath.dirname(page.file.src_uri)

  def rewrite(match):
    target, anchor = match.group(1), match.group(2) or ""
    if "://" in target:
      return match.group(0)
    in_repo = posixpath.normpath(posixpath.join("docs", page_dir, target))
    if not in_repo.startswith("experiments/"):
      return match.group(0)
    return f"]({posixpath.relpath(in_repo, page_dir or '.')}{anchor})"

  return _LINK.sub(rewrite, markdown)
