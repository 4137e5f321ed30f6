"""``python -m ndtrain.cli`` (the form torchrun launches: ``torchrun ... -m ndtrain.cli train``)."""
import sys

from ndtrain.cli.commands import main

sys.exit(main())
