"""Benchmarks, trace replay, profiles, simulator and planner."""

from pdfabric._layout import root_folder

__path__ += root_folder(__file__)  # the modules: the top-level bench/ folder in the source tree

