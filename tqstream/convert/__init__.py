"""Conversion between user formats and columns: a put's input (TensorDict, tensors, numpy, lists,
objects) to columns, and columns to the TensorDict a read returns. Clients use it; storage units,
which only hold and ship columns, never import it."""
