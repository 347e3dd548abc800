// Command h2spec-run runs h2spec's conformance cases (generic, http2, hpack; or
// the sections named as arguments, such as http2/6.9) against one server and
// writes a JUnit report; -dryrun lists the cases. It is our own small driver over
// the h2spec library in $QS_SHARED_TOOLS/h2spec/upstream (default
// ../shared/tools), whose own command is not in that folder. Built by
// scripts/build_h2spec.sh.
package main

import (
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/summerwind/h2spec"
	"github.com/summerwind/h2spec/config"
)

func main() {
	host := flag.String("h", "127.0.0.1", "server host")
	port := flag.Int("p", 2379, "server port")
	timeout := flag.Int("o", 2, "seconds to wait for each answer")
	junit := flag.String("j", "", "write a JUnit report here")
	dryrun := flag.Bool("dryrun", false, "list the cases without running them")
	version := flag.Bool("version", false, "print the version")
	flag.Parse()
	if *version {
		fmt.Println("h2spec-run (the h2spec library of $QS_SHARED_TOOLS/h2spec)")
		return
	}
	c := &config.Config{
		Host:         *host,
		Port:         *port,
		Path:         "/",
		Timeout:      time.Duration(*timeout) * time.Second,
		MaxHeaderLen: 4000,
		JUnitReport:  *junit,
		DryRun:       *dryrun,
		Sections:     flag.Args(),
	}
	ok, err := h2spec.Run(c)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if !ok {
		os.Exit(1)
	}
}
