from benchmarks.peers import run

run.main()
