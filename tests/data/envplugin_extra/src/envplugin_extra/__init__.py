"""Nothing: the fixture checks only that it was installed and then removed."""
