package main

// The wire codec. grpc-go 1.33 (Debian's) marshals through github.com/golang/protobuf 1.3, which cannot handle the
// messages today's protoc-gen-go makes (they carry no struct tags, only protoreflect). This codec, registered
// under gRPC's own name "proto", marshals those through google.golang.org/protobuf and the older messages (the
// health service's) through the old package.

import (
	"fmt"

	protov1 "github.com/golang/protobuf/proto"
	"google.golang.org/grpc/encoding"
	protov2 "google.golang.org/protobuf/proto"
)

type codec struct{}

func (codec) Name() string { return "proto" }

func (codec) Marshal(v any) ([]byte, error) {
	switch m := v.(type) {
	case protov2.Message:
		return protov2.Marshal(m)
	case protov1.Message:
		return protov1.Marshal(m)
	}
	return nil, fmt.Errorf("cannot marshal %T: not a protobuf message", v)
}

func (codec) Unmarshal(data []byte, v any) error {
	switch m := v.(type) {
	case protov2.Message:
		return protov2.Unmarshal(data, m)
	case protov1.Message:
		return protov1.Unmarshal(data, m)
	}
	return fmt.Errorf("cannot unmarshal into %T: not a protobuf message", v)
}

func init() { encoding.RegisterCodec(codec{}) }
