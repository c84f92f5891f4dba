"""MkDocs hooks: the experiments index and result files in the site, and docstrings' roles.

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


def _site_path(repo_path):
  """Where a repository file sits in the site: docs/X at X, experiments/X at experiments/X."""
  if repo_path.startswith("docs/"):
    return repo_path[len("docs/"):]
  if repo_path.startswith("experiments/"):
    return repo_path
  return None


def on_page_markdown(markdown, page, config, files):
  """Rewrites links between docs/ and experiments/, written as the repository has them, into
  links inside the site."""
  src = page.file.src_uri
  page_in_repo = src if src.startswith("experiments/") else f"docs/{src}"
  page_dir = posixpath.dirname(page_in_repo)
  site_dir = posixpath.dirname(src)

  def rewrite(match):
    target, anchor = match.group(1), match.group(2) or ""
    if "://" in target or target.startswith("/"):
      return match.group(0)
    in_site = _site_path(posixpath.normpath(posixpath.join(page_dir, target)))
    if in_site is None:
      return match.group(0)
    return f"]({posixpath.relpath(in_site, site_dir or '.')}{anchor})"

  return _LINK.sub(rewrite, markdown)


_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|obj|exc):(<code>)~?")


def on_page_content(html, page, config, files):
  """Docstrings name objects with Sphinx roles (:class:`Name`); the reference shows the name as
  code without the role."""
  return _ROLE.sub(r"\1", html)
