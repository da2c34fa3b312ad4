import sys
from pathlib import Path

# the shared test helpers beside this file (_*.py) import as top-level modules under importlib import mode
sys.path.insert(0, str(Path(__file__).parent))
