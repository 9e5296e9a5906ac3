"""The repository's own tools, outside the package: ``make docs-figures`` (every measured
figure of README.md and docs/ from the command that produces it), ``make docs-map``
(docs/architecture.md's file map from the tree) and ``make gpu-check`` (what only a GPU
shows, one prepared script for a lent machine)."""
