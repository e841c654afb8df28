"""Where the train state lives: the six-axis mesh, the layout that maps logical
axes onto it, pipeline stages, and host-memory offload of state fields.
"""
