import sys

from mnist_resnet.cli import main

sys.exit(main())
