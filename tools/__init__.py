"""The repository's own tools, outside the package: ``make docs-figures`` (every measured
figure of README.md and docs/ from the command that produces it) and ``make gpu-check``
(what only a GPU shows, one prepared script for a lent machine)."""
