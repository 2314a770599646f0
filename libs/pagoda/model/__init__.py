"""Models (one file per architecture, found by the registry), layers, paged attention
and weight loading."""
