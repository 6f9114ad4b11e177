import sys

from hf_finetune.cli import main

sys.exit(main())
