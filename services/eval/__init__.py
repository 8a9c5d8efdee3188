"""Accuracy a user can measure (`pdmesh eval`): perplexity over sliding windows, and
agreement / KL between two models. windows.py (index arithmetic), scorers.py (in-process
or through a mesh), perplexity.py, agreement.py."""
