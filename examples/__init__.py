"""Networks of one's own that PETRA trains from their import paths (docs/own_model.md)."""
