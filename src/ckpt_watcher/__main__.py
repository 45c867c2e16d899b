from ckpt_watcher.cli import main

main()
