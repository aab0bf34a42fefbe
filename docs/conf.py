"""Sphinx configuration of the ringmpi documentation (``make docs``; warnings are errors)."""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

import ringmpi  # noqa: E402 (after the path; importing ringmpi does not start MPI)

project = "ringmpi"
author = "the ringmpi authors"
release = ringmpi.__version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
master_doc = "index"
exclude_patterns = ["_build"]
napoleon_google_docstring = False
napoleon_numpy_docstring = True
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the numpydoc Parameters give the types and shapes
myst_heading_anchors = 3
html_theme = "alabaster"
