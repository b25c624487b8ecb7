"""Training backends: the model, its optimizer and weight export behind one interface."""
