"""Models (Llama family), layers, paged attention and weight loading."""
