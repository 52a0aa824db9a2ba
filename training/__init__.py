"""Training the embedded model: the shapes data set (shapes.py) and the script (train_embedded.py).
Not part of the installed package; scripts/check_structure.py keeps stagemesh from importing it."""
