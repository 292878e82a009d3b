from services.prefill.server import main

main()
