"""One module per model architecture; each declares a module-level `ARCHITECTURES` table.

`pagoda.model.registry` imports every module here on its first lookup (modules whose
name starts with `_` are skipped), so a new file is all it takes to add one.
"""
