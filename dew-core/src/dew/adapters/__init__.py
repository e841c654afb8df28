"""What a run changes about a model without changing its code: LoRA adapters
(plain and on a scanned layer stack) and quantized matmuls.

The engine never imports these; a recipe or a caller applies them to the
model and the objective before the trainer sees either.
"""
